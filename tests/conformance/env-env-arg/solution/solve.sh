#!/bin/bash
echo "$APP_GREETING" > /app/greeting.txt
