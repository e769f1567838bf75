#!/bin/sh
# A POSIX shell agent (sh, printf, read, sed; no jq) that fixes the guarded-config
# sandbox through gitrun's session protocol: JSON-RPC 2.0, one object per line.
#
#   gitrun run sandboxes/guarded-config \
#       --agent cmd:"sh examples/agents/config_agent.sh sandboxes/guarded-config/patches"
#
# It first tries the naive fix (rename the key in config/defaults.toml), which the
# policy forbids: gitrun refuses it and nothing changes. Then it applies the loader
# fix with its own idempotency key, so a restart after any crash replays the receipt.
set -u
PATCHES=${1:?usage: config_agent.sh PATCH_DIR}
ID=0

log() { printf 'config_agent: %s\n' "$*" >&2; }

# json_string FILE: the file's text as the inside of a JSON string.
json_string() {
    sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/	/\\t/g' -e 's/\r/\\r/g' "$1" |
        while IFS= read -r line; do printf '%s\\n' "$line"; done
}

# call METHOD PARAMS_JSON: send one request, leave the response line in $REPLY_LINE.
call() {
    ID=$((ID + 1))
    printf '{"jsonrpc":"2.0","id":%d,"method":"%s","params":%s}\n' "$ID" "$1" "$2"
    if ! IFS= read -r REPLY_LINE; then
        log "gitrun closed the session"
        exit 1
    fi
}

# field NAME: the string value of "NAME" in the response line (the last one, if several).
# Inside a JSON string a quote is escaped, so '"NAME":"' only matches a real member.
field() { printf '%s\n' "$REPLY_LINE" | sed -n "s/.*\"$1\":\"\([^\"]*\)\".*/\1/p"; }

is_error() { case $REPLY_LINE in *'"error":{'*) return 0 ;; *) return 1 ;; esac; }

call initialize '{"protocol":"gitrun/1"}'
log "run $(field run_id)"
call observe '{}'
log "phase $(field phase)"

call apply_patch "{\"patch\":\"$(json_string "$PATCHES/naive-rename-default-key.diff")\"}"
if is_error; then
    log "naive fix refused: $(field rule)"
else
    log "naive fix was accepted?"
    exit 1
fi

call apply_patch "{\"patch\":\"$(json_string "$PATCHES/fix-loader-legacy-keys.diff")\",\"idempotency_key\":\"config-agent-loader-1\"}"
if is_error; then
    log "loader fix refused: $(field rule)"
    exit 1
fi
log "loader fix committed as $(field commit)"

call finish '{}'
phase=$(field phase)
log "finished: $phase"
[ "$phase" = done ]
