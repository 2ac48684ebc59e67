#!/bin/bash
sort -g /app/readings.txt | tail -1 > /app/max.txt
