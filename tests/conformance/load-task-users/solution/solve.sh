#!/bin/bash
id -un > /tmp/agent-user.txt
