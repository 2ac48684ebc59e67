#!/bin/bash
{ whoami; cat ~/notes.txt; } > /app/who.txt
