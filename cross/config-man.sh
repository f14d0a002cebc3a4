#!/usr/bin/env bash
# imgate.conf(5) from docs/config.md, so the config reference a device carries is the one the
# repository keeps (no second copy to drift): the paragraphs stay paragraphs, each table row
# becomes a tagged paragraph (the key in bold, its default, its meaning), code spans bold,
# links their text. Writes roff to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

# Inline first (sed), then the structure (awk, any awk: OpenWrt builders and Debian have mawk).
sed -E -e 's/\\/\\e/g' \
  -e 's/\[([^]]*)\]\([^)]*\)/\1/g' \
  -e 's/`([^`]*)`/\\fB\1\\fR/g' docs/config.md | awk '
function line(s) {
  gsub(/-/, "\\-", s)                            # an ASCII hyphen, so --config copies as typed
  if (s ~ /^[.\047]/) s = "\\&" s               # a line may not start a request
  return s
}
BEGIN {
  print ".TH IMGATE.CONF 5 \"2026\" \"imgate\" \"File Formats\""
  print ".SH NAME"
  print "imgate.conf \\- the configuration file of imgate"
  print ".SH DESCRIPTION"
  section = "description"
}
NR == 1 && /^# / { next }                         # the title is the NAME above
/^\| key \|/ { print ".SH KEYS"; section = "keys"; gap = 0; next }
/^\| --- \|/ { next }
/^\| / {
  row = substr($0, 3, length($0) - 4)             # without the outer "| " and " |"
  n = split(row, cell, / \| /)
  print ".TP"
  print line(cell[1])
  print "Default: " line(cell[2]) "."
  meaning = cell[3]
  for (i = 4; i <= n; i++) meaning = meaning " | " cell[i]
  print line(meaning)
  next
}
/^$/ {
  if (section == "keys") { print ".SH NOTES"; section = "notes" } else gap = 1
  next
}
{
  if (gap) print ".PP"                            # a paragraph break only between paragraphs
  gap = 0
  print line($0)
}
END {
  print ".SH FILES"
  print ".TP"
  print ".I /etc/imgate/imgate.conf"
  print "The config a packaged imgate reads. Its commented lines are the defaults."
  print ".SH SEE ALSO"
  print ".BR imgate (1)"
}
'
