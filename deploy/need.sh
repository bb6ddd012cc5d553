# Sourced by the deploy/ check scripts: `need COMMAND DEBIAN_PACKAGE` installs the package with
# apt-get when the command is missing (as root, or through sudo), and fails loudly otherwise.
# Packages whose maintainer scripts would start a service (prometheus) are installed with a
# policy-rc.d that forbids it, so nothing is left running.
need() {
  local cmd=$1 pkg=$2 sudo=
  command -v "$cmd" >/dev/null && return 0
  [ "$(id -u)" = 0 ] || sudo=sudo
  command -v apt-get >/dev/null || { echo "$cmd not found and no apt-get to install $pkg: install it" >&2; return 1; }
  echo "$cmd not found: installing Debian's $pkg package"
  local policy=/usr/sbin/policy-rc.d added=
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod +x "$policy" && added=1
  fi
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null
  local rc=$?
  [ -n "$added" ] && $sudo rm -f "$policy"
  [ $rc = 0 ] && command -v "$cmd" >/dev/null || { echo "installing $pkg did not provide $cmd" >&2; return 1; }
}
