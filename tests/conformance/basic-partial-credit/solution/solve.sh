#!/bin/bash
tr '[:lower:]' '[:upper:]' < /app/notes.txt > /app/notes.upper.txt
