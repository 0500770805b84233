#!/usr/bin/env bash
# The README's config reference must be exactly what the daemon's table generates
# (`kvserve --help-config --markdown`; refresh with scripts/update-readme-config).
set -u
KVS=${KVS_BUILD:-build}/kvserve
want=$("$KVS" --help-config --markdown)
have=$(sed -n '/<!-- config-table:begin -->/,/<!-- config-table:end -->/p' README.md | sed '1d;$d')
if [ "$want" = "$have" ]; then echo "README config table is up to date ($(wc -l <<<"$want") lines)"; exit 0; fi
diff <(echo "$want") <(echo "$have") | head -20
echo "README.md config table is stale: run scripts/update-readme-config"
exit 1
