#!/usr/bin/env bash
# Install dp_hf from this checkout with the given extras (CPU torch pinned by constraints-cpu.txt),
# unless this environment already has them: a stamp (hash of the python, pyproject.toml, the
# constraints and the extras) is left in .install-stamps/ after a successful install, so the README's
# second command skips what its first one installed, and reruns install nothing.
#   scripts/install.sh recipes          # what the demo needs
#   scripts/install.sh test,recipes     # what the tests need
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:?usage: scripts/install.sh EXTRAS (e.g. test,recipes)}"
stamp_of() {
  { python -c "import sys; print(sys.executable, sys.version)"; cat pyproject.toml constraints-cpu.txt; echo "$1"; } \
    | sha256sum | cut -c1-16
}
installed() {
  # Each extra in $1 is covered by some earlier install's stamp, and the environment still holds what
  # it installed (scripts/check_installed.py: a stamp outlives a reset environment).
  local extra checkout="$PWD"
  for extra in ${1//,/ }; do
    [ -e ".install-stamps/$(stamp_of "$extra")" ] || return 1
  done
  (cd / && python "$checkout/scripts/check_installed.py" "$1" "$checkout")
}
if installed "$extras"; then
  echo "dp_hf[$extras] already installed in this environment (scripts/install.sh); skipping pip."
  exit 0
fi
echo "Installing dp_hf[$extras] with pip (about 2 minutes on a fresh machine)..."
python -m pip install -q --root-user-action=ignore -c constraints-cpu.txt -e ".[$extras]"
mkdir -p .install-stamps
for extra in ${extras//,/ }; do
  touch ".install-stamps/$(stamp_of "$extra")"
done
