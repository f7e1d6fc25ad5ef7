#!/bin/sh
# Tools the ops tests need that pip cannot provide: systemd-analyze and systemd-sysusers, from
# Debian's systemd package (tests/ops/test_systemd_unit.py). Idempotent: does nothing when they are
# there. Without root or apt-get it only says what is missing; the tests then fail (as root) or skip
# (as another user), naming this script.
set -eu

missing=""
for tool in systemd-analyze systemd-sysusers; do
    command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
done
[ -z "$missing" ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-tools: missing:$missing; install Debian's systemd package as root" \
        "(apt-get install systemd)" >&2
    exit 0
fi
echo "install-tools: installing Debian's systemd package for:$missing" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null
