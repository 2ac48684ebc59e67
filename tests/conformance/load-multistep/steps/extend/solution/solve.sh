#!/bin/bash
sed 's/$/,1/' /app/new_items.txt >> /app/inventory.csv
