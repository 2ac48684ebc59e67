#!/bin/bash
python3 -c "import json, os, urllib.request; print(sum(json.load(urllib.request.urlopen(os.environ['INVENTORY_URL'] + '/stock')).values()))" > /app/total.txt
