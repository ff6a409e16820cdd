#!/bin/sh
# After removal: forget the unit.
set -e
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
fi
