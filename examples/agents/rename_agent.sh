#!/bin/sh
# A POSIX shell agent that solves the rename-api sandbox with one `exec` step over
# gitrun's session protocol (JSON-RPC 2.0 lines; sh, printf, read, sed; no jq):
#
#   gitrun run sandboxes/rename-api --agent cmd:"sh examples/agents/rename_agent.sh"
#
# It searches HEAD for the old name, runs `sed -i` over the package as one step (gitrun
# commits the whole change the command made as one receipt), checks that the old name
# is gone, and finishes. Its own idempotency key makes a restart after a crash replay
# the receipt instead of running sed twice.
set -u
ID=0

log() { printf 'rename_agent: %s\n' "$*" >&2; }

call() {
    ID=$((ID + 1))
    printf '{"jsonrpc":"2.0","id":%d,"method":"%s","params":%s}\n' "$ID" "$1" "$2"
    if ! IFS= read -r REPLY_LINE; then
        log "gitrun closed the session"
        exit 1
    fi
    case $REPLY_LINE in *'"error":{'*) log "$1 refused: $REPLY_LINE"; exit 1 ;; esac
}

# field NAME: the string value of "NAME" in the response line (the last one, if several)
field() { printf '%s\n' "$REPLY_LINE" | sed -n "s/.*\"$1\":\"\([^\"]*\)\".*/\1/p"; }

# hits: how many matches a search answer holds
hits() { printf '%s\n' "$REPLY_LINE" | grep -o '"line":' | wc -l | tr -d ' '; }

call initialize '{"protocol":"gitrun/1"}'
log "run $(field run_id)"
call search '{"pattern":"calc_area","glob":"geometry/*.py"}'
log "calc_area at HEAD: $(hits) lines"
if [ "$(hits)" -gt 0 ]; then
    call exec '{"command":"sed -i '"'"'s/calc_area/circle_area/g'"'"' geometry/*.py","idempotency_key":"rename-agent-sed-1"}'
    log "exec committed $(field commit): exit code $(printf '%s\n' "$REPLY_LINE" | sed -n 's/.*"exit_code":\([0-9-]*\).*/\1/p')"
fi
call search '{"pattern":"calc_area","glob":"geometry/*.py"}'
[ "$(hits)" -eq 0 ] || { log "calc_area is still there"; exit 1; }
call finish '{}'
log "finished: $(field phase)"
[ "$(field phase)" = done ]
