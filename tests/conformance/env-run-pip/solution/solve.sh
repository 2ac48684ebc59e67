#!/bin/bash
python3 -c 'import json, tomli_w; print(tomli_w.dumps(json.load(open("/app/data.json"))), end="")' > /app/data.toml
