#!/bin/sh
cat /app/parts/a.txt /app/parts/b.txt /opt/extra/c.txt
