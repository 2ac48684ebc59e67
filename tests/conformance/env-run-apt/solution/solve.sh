#!/bin/bash
echo '2^70' | bc > /app/big.txt
