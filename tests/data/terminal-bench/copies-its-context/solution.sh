#!/bin/bash
echo octarine > /app/answer.txt
