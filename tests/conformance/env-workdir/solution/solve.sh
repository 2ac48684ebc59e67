#!/bin/bash
# relative paths: the shell starts in the image's WORKDIR
python3 main.py > result.txt
