#!/bin/bash
mkdir -p /app/out
echo 'hello from a prebuilt image' > /app/out/greeting.txt
