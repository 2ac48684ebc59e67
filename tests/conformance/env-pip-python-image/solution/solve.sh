#!/bin/bash
/usr/local/bin/python3 -c 'import json, tomli_w; print(tomli_w.dumps(json.load(open("/app/settings.json"))), end="")' > /app/settings.toml
