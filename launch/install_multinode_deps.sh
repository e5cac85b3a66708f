#!/bin/sh
# Install what the Tier 2 (multi-node) tests need on a Debian/Ubuntu machine: an sshd to run per network
# namespace and pdsh for the deepspeed launcher. Idempotent and quiet: exits 0 at once when both are present.
# Needs root (apt-get). Used by tests/helpers/netns.py when sshd or pdsh is missing; safe to run by hand.
set -eu

have() { [ -x /usr/sbin/sshd ] && command -v pdsh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1; }

if have; then
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "install_multinode_deps.sh: needs root to apt-get install openssh-server pdsh" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp /tmp/ftkit-install-deps.XXXXXX)
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends openssh-server openssh-client pdsh; } \
        >"$log" 2>&1; then
    echo "install_multinode_deps.sh: apt-get failed; last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
fi
rm -f "$log"

# The package's postinst may start a system sshd on port 22 where an init system exists; the tests never use it
# and start their own per-namespace daemons, so it is left as the distribution configured it.
if ! have; then
    echo "install_multinode_deps.sh: installed, but sshd/pdsh/ssh-keygen still not found" >&2
    exit 1
fi
