#!/bin/bash
join-parts > /app/joined.txt
