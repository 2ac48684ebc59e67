#!/bin/bash
mkdir -p /app/release
echo 2.4.1 > /app/release/VERSION
printf '#!/bin/sh\necho ok\n' > /app/release/run.sh
chmod +x /app/release/run.sh
