# fill-secrets.awk: a config template with its secret placeholders replaced, each secret read from a
# file, never from a command line, the environment or a log:
#
#   awk -v hash_key_file=PATH [-v peer_secret_file=PATH] -f fill-secrets.awk TEMPLATE > RENDERED
#
# Replaces "__HASH_KEY__" (plugin hash_key) and "__PREFIX_ROUTER_PEER_SECRET__" (peers.secret)
# where they are quoted JSON strings; a comment that mentions a placeholder stays as it is, so no
# secret lands in a comment. Used by docker/envoy-start.sh (compose) and the Kubernetes init
# containers (envoy/k8s), which run it from the export image (docker/filter.Dockerfile).
#
# Exits 1, naming the file or the placeholder and never the value, when a secret file cannot be
# read, holds fewer than 16 characters or a character other than printable ASCII without space,
# quotes, backslash or brackets (it is written into JSON inside YAML unescaped), is itself a
# placeholder, or when a quoted "__NAME__" placeholder is left that no file fills: a config that
# still holds a public placeholder never starts (the filter refuses placeholders too).

function fail(msg) {
    print "fill-secrets: " msg > "/dev/stderr"
    failed = 1
    exit 1
}

function secret(path, what,    line, v, r) {
    if (path == "")
        return ""
    v = ""
    while ((r = (getline line < path)) > 0)
        v = v line
    if (r < 0)
        fail("cannot read " what " from " path)
    close(path)
    sub(/^[ \t\r]+/, "", v)
    sub(/[ \t\r]+$/, "", v)
    if (v ~ /^__[A-Z0-9_]+__$/)
        fail(what " in " path " is itself a placeholder")
    if (length(v) < 16)
        fail(what " in " path " must hold at least 16 characters")
    if (v ~ /[^A-Za-z0-9!#$%&'()*+,.\/:;<=>?@^_`{|}~-]/)
        fail(what " in " path " holds a character other than printable ASCII without space, quotes, backslash or brackets")
    return v
}

function put(line, ph, v, opt,    q, i) {
    q = "\"" ph "\""
    while ((i = index(line, q)) > 0) {
        if (v == "")
            fail("line " NR ": " ph " needs -v " opt "=PATH (its secret's file)")
        line = substr(line, 1, i) v substr(line, i + length(q) - 1)
    }
    return line
}

BEGIN {
    key = secret(hash_key_file, "the hash key")
    peer = secret(peer_secret_file, "the peer secret")
}

{
    line = put($0, "__HASH_KEY__", key, "hash_key_file")
    line = put(line, "__PREFIX_ROUTER_PEER_SECRET__", peer, "peer_secret_file")
    if (match(line, /"__[A-Z0-9_]+__"/))
        fail("line " NR ": placeholder " substr(line, RSTART + 1, RLENGTH - 2) " is left and no file fills it")
    print line
}

END {
    if (failed)
        exit 1
}
