#!/bin/bash
sort /app/words.txt > /app/sorted.txt
