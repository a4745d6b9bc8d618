# Sourced by start.sh and stop.sh.
# running PIDFILE NAME: the pid file names a live process called NAME. A pid file left by a
# daemon that died with its machine (a restarted container, CI on a machine a test run left
# its files on) may name a pid that a process of this boot now has, even the script reading
# it: `kill -0` alone would take that process for the daemon (and stop.sh would kill it).
running() { [ -s "$1" ] && [ "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" = "$2" ]; }
