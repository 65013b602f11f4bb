//! The POSIX `sh` programs that keep jobs inside the computer (docs/jobs.md, "Inside the
//! computer"). Every value reaches them as a positional argument, never spliced into the text,
//! so nothing a caller sends is parsed as shell. They need only what BusyBox has: `mkfifo`,
//! `setsid`, `dd`, `wc`, `tail`, `head`, `awk`, `grep`, `date`.
//!
//! A job's directory holds `meta.json` and `summary.json` (written once at start), `cmd`, the
//! raw `stdout` and `stderr`, `order` (one `O <n>` or `E <n>` line per chunk, appended after
//! the chunk's bytes, so it gives the combined order and every offset of the combined
//! stream), `pid` (the supervisor), `holder` (the process keeping stdin open) and `exit`
//! (`<code|-> <ended_at>`, written once, last).

/// Where job directories live: the first one writable by the computer's user.
const FIND_BASE: &str = r#"B=
for b in /.kilntainers/jobs /tmp/.kilntainers/jobs; do
  if mkdir -p "$b" 2>/dev/null && [ -w "$b" ]; then B=$b; break; fi
done
"#;

/// Shared by the scripts that look at jobs: `alive` says whether a job's supervisor still runs
/// (checked by the tag in its environment, so a reused pid does not count); `settle` records
/// the end of a job whose supervisor died without writing `exit` (the computer restarted):
/// exit code unknown, ended now; `stdin_open` whether `job_write` can still reach the job.
pub(super) const JOB_FUNCTIONS: &str = r#"alive() {
  { read -r sp < "$1/pid"; } 2>/dev/null && grep -q "KILNTAINERS_EXEC_ID=jobsup-${1##*/}" "/proc/$sp/environ" 2>/dev/null
}
settle() {
  [ -f "$1/exit" ] && return 0
  alive "$1" && return 0
  [ -f "$1/exit" ] && return 0
  printf -- '- %s\n' "$(date -u '+%Y-%m-%dT%H:%M:%SZ %s')" > "$1/exit.$$" && mv "$1/exit.$$" "$1/exit"
}
stdin_open() {
  [ -f "$1/exit" ] && return 1
  { read -r hp < "$1/holder"; } 2>/dev/null && grep -q "KILNTAINERS_EXEC_ID=jobsup-${1##*/}" "/proc/$hp/environ" 2>/dev/null
}
"#;

/// `d` = the directory of job `$j`, or empty.
pub(super) const FIND_JOB: &str = r#"d=
for b in /.kilntainers/jobs /tmp/.kilntainers/jobs; do
  if [ -d "$b/$j" ]; then d=$b/$j; break; fi
done
"#;

/// Starts a job: `$1` id, `$2` shell, `$3` timeout seconds (0 = none), `$4` keep stdin open
/// (0/1), `$5` initial stdin on this script's stdin (0/1), `$6` working directory or empty,
/// `$7` meta.json, `$8` summary.json, `$9` the command, `$10` the most running jobs allowed,
/// `$11` the job log limit in bytes, `$12` [`SUPERVISOR`]. Prints `started`, `busy <n>`, `exists` or `failed <why>`.
pub fn start() -> String {
    format!(
        r#"j=$1
{FIND_BASE}[ -n "$B" ] || {{ echo "failed no writable /.kilntainers or /tmp"; exit 0; }}
{JOB_FUNCTIONS}n=0
for o in "$B"/j-*; do
  [ -d "$o" ] && [ ! -f "$o/exit" ] && alive "$o" && n=$((n+1))
done
[ "$n" -lt "${{10}}" ] || {{ echo "busy $n"; exit 0; }}
d=$B/$j
mkdir "$d" 2>/dev/null || {{ echo exists; exit 0; }}
printf '%s\n' "$7" > "$d/meta.json"
printf '%s\n' "$8" > "$d/summary.json"
printf '%s' "$9" > "$d/cmd"
if [ "$5" = 1 ]; then cat > "$d/stdin.data"; fi
: > "$d/stdout"; : > "$d/stderr"; : > "$d/order"
mkfifo "$d/o.pipe" "$d/e.pipe" || {{ echo "failed mkfifo"; exit 0; }}
if [ "$4" = 1 ]; then mkfifo "$d/stdin" || {{ echo "failed mkfifo"; exit 0; }}; fi
cd /
if command -v setsid >/dev/null 2>&1; then detach=setsid; else detach=; fi
KILNTAINERS_EXEC_ID="jobsup-$j" $detach "$2" -c "${{12}}" kilntainers-job "$d" "$j" "$2" "$3" "$4" "$5" "$6" "${{11}}" </dev/null >/dev/null 2>&1 &
i=0
while [ ! -f "$d/pid" ] && [ "$i" -lt 500 ]; do sleep 0.01; i=$((i+1)); done
if [ -f "$d/pid" ]; then echo started; else echo "failed the job did not start"; fi
"#
    )
}

/// The job's supervisor, started detached by [`start`] with the job's directory and settings.
/// Relays copy the command's stdout and stderr chunk by chunk into the files and `order`; a
/// watchdog ends the job at its timeout; `exit` is written once everything has drained.
pub const SUPERVISOR: &str = r#"d=$1; j=$2; sh_=$3; t=$4; keep=$5; hs=$6; wd=$7; lim=$8
echo $$ > "$d/pid.tmp" && mv "$d/pid.tmp" "$d/pid"
trap ':' TERM INT HUP
relay() {
  c="$d/$1.chunk"; kept=0; dropped=0
  while :; do
    dd bs=65536 count=1 of="$c" 2>/dev/null
    n=$(wc -c < "$c"); n=$((n))
    [ "$n" -gt 0 ] || break
    if [ $((kept + n)) -le "$lim" ]; then
      cat "$c" >> "$d/$2"; echo "$1 $n" >> "$d/order"; kept=$((kept + n))
    else
      dropped=$((dropped + n))
    fi
  done
  if [ "$dropped" -gt 0 ]; then
    m="
[kilntainers: job log limit reached; $dropped further bytes of this stream were not kept]
"
    printf '%s' "$m" >> "$d/$2"; echo "$1 ${#m}" >> "$d/order"
  fi
  rm -f "$c"
}
sigtag() {
  for p in /proc/[0-9]*; do
    grep -q "KILNTAINERS_EXEC_ID=job-$j" "$p/environ" 2>/dev/null && kill -"$1" "${p#/proc/}" 2>/dev/null
  done
}
relay O stdout < "$d/o.pipe" & ro=$!
relay E stderr < "$d/e.pipe" & re=$!
if [ "$keep" = 1 ]; then
  sleep 2147483647 <> "$d/stdin" & echo $! > "$d/holder"
  in=$d/stdin
  if [ "$hs" = 1 ]; then cat "$d/stdin.data" > "$d/stdin" & fi
elif [ "$hs" = 1 ]; then
  in=$d/stdin.data
else
  in=/dev/null
fi
( if [ -n "$wd" ]; then cd "$wd" || exit 1; fi
  KILNTAINERS_EXEC_ID="job-$j" exec "$sh_" -c "$(cat "$d/cmd")" ) < "$in" > "$d/o.pipe" 2> "$d/e.pipe" &
cp=$!
wp=
if [ "$t" -gt 0 ]; then
  ( trap 'kill $s 2>/dev/null; exit 0' TERM
    sleep "$t" & s=$!; wait $s
    : > "$d/timedout"
    for pass in 1 2 3; do sigtag KILL; sleep 0.1; done ) &
  wp=$!
fi
wait "$cp"; rc=$?
while kill -0 "$cp" 2>/dev/null; do wait "$cp"; rc=$?; done
for r in $ro $re; do
  while kill -0 "$r" 2>/dev/null; do wait "$r"; done
done
[ -n "$wp" ] && kill "$wp" 2>/dev/null
if [ -f "$d/holder" ]; then read -r h < "$d/holder"; kill "$h" 2>/dev/null; fi
if [ -f "$d/timedout" ]; then
  rc=124
  m="[kilntainers: command timed out after ${t}s]"
  if [ -s "$d/stderr" ] && [ -n "$(tail -c 1 "$d/stderr")" ]; then m="
$m"; fi
  printf '%s' "$m" >> "$d/stderr"; echo "E ${#m}" >> "$d/order"
fi
printf '%s %s\n' "$rc" "$(date -u '+%Y-%m-%dT%H:%M:%SZ %s')" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
rm -f "$d/o.pipe" "$d/e.pipe" "$d/stdin" "$d/stdin.data"
"#;

/// Reads a job: `$1` id, `$2` offset in the combined stream, `$3` the most bytes to return,
/// `$4` seconds to wait, `$5` what ends the wait: `output` (new output or the end) or `end`.
/// Prints `missing`, or four lines — the state (`running` or `ended <code|-> <ended_at>
/// <ended epoch>`), whether stdin is open (1/0), `<stdout offset> <stderr offset> <stdout
/// bytes> <stderr bytes> <total>` and summary.json — then the stdout bytes; the stderr bytes
/// go to stderr.
pub fn read() -> String {
    format!(
        r#"j=$1; s=$2; cap=$3; w=$4; until=$5
{JOB_FUNCTIONS}{FIND_JOB}[ -n "$d" ] || {{ echo missing; exit 0; }}
quiet() {{
  [ "$until" = end ] && return 0
  [ "$(awk '{{t += $2}} END {{printf "%.0f\n", t}}' "$d/order")" -le "$s" ]
}}
settle "$d"
i=0; k=$((w * 10))
while [ ! -f "$d/exit" ] && quiet && [ "$i" -lt "$k" ]; do
  sleep 0.1; i=$((i+1))
  [ $((i % 10)) -eq 0 ] && settle "$d"
done
if [ -f "$d/exit" ]; then read -r code at ep < "$d/exit"; st="ended $code $at $ep"; else st=running; fi
if stdin_open "$d"; then in=1; else in=0; fi
plan=$(awk -v s="$s" -v cap="$cap" '
  BEGIN {{ left = cap }}
  {{ n = $2 + 0
    if (pos + n <= s) {{ if ($1 == "O") so += n; else se += n; pos += n; next }}
    skip = s - pos; if (skip < 0) skip = 0
    if ($1 == "O") so += skip; else se += skip
    take = n - skip; if (take > left) take = left
    if ($1 == "O") to += take; else te += take
    left -= take; pos += n }}
  END {{ printf "%.0f %.0f %.0f %.0f %.0f\n", so, se, to, te, pos }}' "$d/order")
printf '%s\n%s\n%s\n' "$st" "$in" "$plan"
head -n 1 "$d/summary.json"
set -- $plan
[ "$3" -gt 0 ] && tail -c +$(($1 + 1)) "$d/stdout" | head -c "$3"
[ "$4" -gt 0 ] && tail -c +$(($2 + 1)) "$d/stderr" | head -c "$4" >&2
exit 0
"#
    )
}

/// Writes to a job's stdin: `$1` id, `$2` data on this script's stdin (0/1), `$3` close stdin
/// afterwards (0/1). Prints `missing`, `closed` or `ok`.
pub fn write() -> String {
    format!(
        r#"j=$1
{JOB_FUNCTIONS}{FIND_JOB}[ -n "$d" ] || {{ echo missing; exit 0; }}
stdin_open "$d" || {{ echo closed; exit 0; }}
if [ "$2" = 1 ]; then cat > "$d/stdin"; fi
if [ "$3" = 1 ]; then kill "$hp" 2>/dev/null; fi
echo ok
"#
    )
}

/// Signals every process of a job (`$1` id, `$2` signal name) and waits up to `$3` seconds
/// for it to end. Prints `missing`, `ended` or `running`.
pub fn signal() -> String {
    format!(
        r#"j=$1
{JOB_FUNCTIONS}{FIND_JOB}[ -n "$d" ] || {{ echo missing; exit 0; }}
settle "$d"
[ -f "$d/exit" ] && {{ echo ended; exit 0; }}
for p in /proc/[0-9]*; do
  grep -q "KILNTAINERS_EXEC_ID=job-$j" "$p/environ" 2>/dev/null && kill -"$2" "${{p#/proc/}}" 2>/dev/null
done
i=0; k=$(($3 * 10))
while [ ! -f "$d/exit" ] && [ "$i" -lt "$k" ]; do sleep 0.1; i=$((i+1)); done
settle "$d"
if [ -f "$d/exit" ]; then echo ended; else echo running; fi
"#
    )
}

/// Ends the supervisor of a job whose command is gone but whose output never closed (a
/// process that escaped every sweep still holds it): `$1` id. The job is then settled.
pub fn abandon() -> String {
    format!(
        r#"j=$1
{JOB_FUNCTIONS}{FIND_JOB}[ -n "$d" ] || {{ echo missing; exit 0; }}
if alive "$d"; then kill -9 "$sp" 2>/dev/null; fi
if stdin_open "$d"; then kill -9 "$hp" 2>/dev/null; fi
i=0
while alive "$d" && [ "$i" -lt 20 ]; do sleep 0.1; i=$((i+1)); done
settle "$d"
echo ok
"#
    )
}

/// Lists the jobs of the computer, settling those the computer's restart ended: `$1` the most
/// rows. Running jobs come first, then the ended ones newest first (by their `summary.json`,
/// written once at the start), until `$1` rows. For each job: `J <id>`, its summary.json line,
/// its `exit` line or `running`, and `<stdout+stderr bytes>` (from `stat`: BusyBox `wc -c`
/// reads a whole log); last, `T <number of jobs>`.
pub fn list() -> String {
    format!(
        r#"{JOB_FUNCTIONS}lim=$1; n=0; total=0
row() {{
  printf 'J %s\n' "${{1##*/}}"
  head -c 2048 "$1/summary.json" | head -n 1
  if [ -f "$1/exit" ]; then head -n 1 "$1/exit"; else echo running; fi
  set -- $(stat -c %s "$1/stdout" "$1/stderr" 2>/dev/null) 0 0
  echo $(($1 + $2))
}}
all=$(ls -t /.kilntainers/jobs/j-*/summary.json /tmp/.kilntainers/jobs/j-*/summary.json 2>/dev/null)
for f in $all; do settle "${{f%/*}}"; total=$((total + 1)); done
for pass in running ended; do
  for f in $all; do
    d=${{f%/*}}
    if [ -f "$d/exit" ]; then [ "$pass" = ended ] || continue; else [ "$pass" = running ] || continue; fi
    [ "$n" -lt "$lim" ] || break 2
    row "$d"; n=$((n + 1))
  done
done
echo "T $total"
exit 0
"#
    )
}
