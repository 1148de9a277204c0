#!/usr/bin/env bash
# Builds idem-lab as it was at git revision REV into OUT, for
# `idem-lab bench --baseline-bin OUT`: a change is judged against the build
# it replaces (REV HEAD: the uncommitted work against the last commit). The
# build happens in a detached worktree in a temporary directory, removed
# afterwards, so the work tree and its uncommitted changes are untouched.
# -buildvcs=false: the temporary worktree's VCS stamp would say nothing.
set -euo pipefail

if [ $# -ne 2 ]; then
	echo "usage: $0 REV OUT" >&2
	exit 2
fi
rev=$1 out=$2
case $out in /*) ;; *) out=$PWD/$out ;; esac
go=${GO:-go}
top=$(git rev-parse --show-toplevel)
commit=$(git -C "$top" rev-parse --verify --quiet "$rev^{commit}") || {
	echo "build-baseline: $rev is not a commit" >&2
	exit 2
}

tmp=$(mktemp -d)
cleanup() {
	git -C "$top" worktree remove --force "$tmp/src" 2>/dev/null || true
	rm -rf "$tmp"
}
trap cleanup EXIT

git -C "$top" worktree add --detach --quiet "$tmp/src" "$commit"
mkdir -p "$(dirname "$out")"
(cd "$tmp/src" && "$go" build -buildvcs=false -o "$out" ./cmd/idem-lab)
echo "build-baseline: idem-lab of ${commit:0:12} ($rev) in $out" >&2
