#!/bin/sh
# After install or upgrade (deb: configure; rpm: $1 = 1 or 2): create the
# worker user, let the group read the configuration, reload systemd. The
# service is not enabled or started here: it needs APP_DATABASE_URL in
# /etc/worker/worker.env first (see /usr/share/doc/worker or README.md).
set -e
if command -v systemd-sysusers >/dev/null 2>&1; then
	systemd-sysusers /usr/lib/sysusers.d/worker.conf
elif ! getent passwd worker >/dev/null; then
	useradd --system --user-group --home-dir / --no-create-home --shell /usr/sbin/nologin worker
fi
chgrp worker /etc/worker/worker.yaml
chmod 0640 /etc/worker/worker.yaml
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
	# An upgrade restarts a running worker onto the new binary.
	systemctl try-restart worker.service || true
fi
