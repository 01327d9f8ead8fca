#!/bin/bash
# Counts its runs outside /tests and /logs (which each evaluation starts afresh), and
# takes a few seconds, so that a test can cut an evaluation off or run two at once.
echo run >> /var/tmp/verifier-runs
sleep 4
if [ -f /app/done ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
