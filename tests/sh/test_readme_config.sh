#!/usr/bin/env bash
# The README's config reference must list every key the daemon knows (it is generated from
# the same table: `kvserve --help-config --markdown`).
set -u
KVS=${KVS_BUILD:-build}/kvserve
missing=0
while read -r key; do
  grep -qF "\`$key\`" README.md || { echo "README.md lacks config key $key"; missing=1; }
done < <("$KVS" --help-config --markdown | sed -n 's/^| `\([^`]*\)`.*/\1/p')
[ $missing = 0 ] && echo "all config keys documented"
exit $missing
