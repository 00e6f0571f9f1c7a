#!/usr/bin/env bash
# Install what scripts/slurm_cluster.py needs for a local test SLURM cluster on Debian 12:
#   slurm-wlm (slurmctld, slurmd, client commands; Slurm 22.05), munge, slurmdbd and a
#   MariaDB server (real accounting, so `sacct` -- which submitit polls -- reports FAILED
#   for a job that dies), iproute2 / util-linux (network namespaces, nsenter, unshare).
#
# Idempotent and quiet; returns in well under a second when everything is present.
# Needs root. Services are NOT started or enabled: the cluster script runs private daemons
# (its own munged, mariadbd, slurmdbd, slurmctld, slurmd) under a state folder.
set -euo pipefail

PKGS=(slurm-wlm slurmdbd munge mariadb-server mariadb-client iproute2 util-linux procps)
BINS=(slurmctld slurmd slurmdbd sbatch sacct sacctmgr munged munge mariadbd mariadb-install-db mariadb mariadb-dump mariadb-admin ip nsenter unshare)

missing=0
for b in "${BINS[@]}"; do
    if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$b" >/dev/null 2>&1; then
        missing=1
        break
    fi
done
if [[ $missing -eq 0 ]]; then
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "slurm_deps.sh: must run as root (apt-get install)" >&2
    exit 1
fi

# Keep apt's maintainer scripts from starting munge / mariadb / slurm services: the cluster
# script runs its own private daemons. A policy-rc.d already in place (containers) is kept.
own_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
fi
cleanup() { if [[ $own_policy -eq 1 ]]; then rm -f /usr/sbin/policy-rc.d; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp /tmp/slurm_deps.XXXXXX.log)
if ! { apt-get update -qq && \
       apt-get install -y -qq --no-install-recommends "${PKGS[@]}"; } >"$log" 2>&1; then
    echo "slurm_deps.sh: apt-get failed; log follows" >&2
    tail -n 50 "$log" >&2
    exit 1
fi
rm -f "$log"

for b in "${BINS[@]}"; do
    if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$b" >/dev/null 2>&1; then
        echo "slurm_deps.sh: $b still missing after install" >&2
        exit 1
    fi
done
echo "slurm_deps.sh: installed $(slurmctld -V 2>/dev/null || echo slurm), munge, slurmdbd, mariadb"
