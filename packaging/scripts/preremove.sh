#!/bin/sh
# Before removal (deb: remove; rpm: $1 = 0, not an upgrade): stop and
# disable the service. The user and /etc/worker stay, as packages do.
set -e
case "$1" in
remove | 0)
	if [ -d /run/systemd/system ]; then
		systemctl disable --now worker.service || true
	fi
	;;
esac
