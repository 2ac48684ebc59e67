#!/bin/bash
wordfreq /app/text.txt > /app/top.txt
