#!/bin/bash
echo item,count > /app/inventory.csv
sed 's/$/,1/' /app/items.txt >> /app/inventory.csv
