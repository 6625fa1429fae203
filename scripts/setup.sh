#!/usr/bin/env bash
# Installs a2tune and everything its tests need on a bare machine (idempotent; a second run is quick).
# torch comes first at a pinned CPU build so that no dependency range pulls another (CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==${A2_TORCH_VERSION:-2.13.0}"
fi
$PY -m pip install -q -e ".[test,docs]"   # docs: tests/test_docs.py builds the docs site
# Java runs the PTB tokenizer and METEOR; Chromium renders the MLflow UI in one integration test; sshd, rsync and
# nc let the cluster-launch test run `ray up` / `ray submit` / `ray down` against this machine.
need=()
command -v java >/dev/null 2>&1 || need+=(default-jre-headless)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v nc >/dev/null 2>&1 || need+=(netcat-openbsd)
# A C compiler builds the kill-anywhere test's write watcher (tests/faults/fswrites.c, loaded by LD_PRELOAD).
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || need+=(gcc libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
      || echo "setup: could not install ${need[*]} (the tests that need them will say so and skip)" >&2
  else
    echo "setup: please install ${need[*]} (the tests that need them will say so and skip)" >&2
  fi
fi
