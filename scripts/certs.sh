#!/usr/bin/env bash
# Mints the certificates of a Shardcast cluster with openssl (for the demo, the tests and bare-metal
# deployments), installed beside shardcastd as shardcast-certs: `--help` says what it makes.
set -euo pipefail

usage() {
  cat <<EOF
Usage: $(basename "$0") DIR [NODE...]

Mints the certificates of a Shardcast cluster into DIR with openssl: a cluster CA, daemon
identities and a client identity (on Kubernetes, cert-manager does this instead).

Arguments:
  DIR        where the files go (created if missing; a CA already there is kept, so re-running
             adds certificates signed by it)
  NODE...    one daemon identity per node name (letters, digits, '.', '_', '-'); without any,
             one identity for every daemon

Outputs, in DIR:
  ca.pem, ca.key          the cluster CA
  daemon.pem, daemon.key  the daemon identity (DNS name shardcast-daemon), when no NODE is given
  NODE.pem, NODE.key      each node's daemon identity (DNS names shardcast-daemon and NODE)
  client.pem, client.key  a client identity, for TCP clients (the Peer service refuses it)

Keys are EC P-256, mode 0600; certificates are valid for 825 days (\$CERT_DAYS to change).
EOF
}

if [ $# -lt 1 ]; then
  usage >&2
  exit 2
fi
if [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  usage
  exit 0
fi
command -v openssl >/dev/null || { echo "certs.sh: openssl is not installed (apt-get install openssl)" >&2; exit 1; }
dir="$1"; shift
days="${CERT_DAYS:-825}"
mkdir -p "$dir"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

if [ ! -s "$dir/ca.pem" ] || [ ! -s "$dir/ca.key" ]; then
  key "$dir/ca.key"
  openssl req -x509 -new -key "$dir/ca.key" -days "$days" -subj "/O=shardcast/CN=shardcast-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/ca.pem" 2>/dev/null
fi

# issue NAME CN SAN USAGE
issue() {
  local name="$1" cn="$2" san="$3" usage="$4" ext
  ext="$(mktemp)"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -n "$san" ] && echo "subjectAltName=$san"
  } >"$ext"
  key "$dir/$name.key"
  openssl req -new -key "$dir/$name.key" -subj "/O=shardcast/CN=$cn" -out "$dir/$name.csr" 2>/dev/null
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days "$days" -extfile "$ext" -out "$dir/$name.pem" 2>/dev/null
  rm -f "$dir/$name.csr" "$ext"
}

if [ $# -eq 0 ]; then
  issue daemon shardcast-daemon "DNS:shardcast-daemon" "serverAuth,clientAuth"
else
  for node in "$@"; do
    case "$node" in
      *[!A-Za-z0-9._-]*|"") echo "certs.sh: node name \"$node\" must be letters, digits, '.', '_' or '-'" >&2; exit 2 ;;
    esac
    issue "$node" "shardcast-daemon:$node" "DNS:shardcast-daemon,DNS:$node" "serverAuth,clientAuth"
  done
fi
issue client shardcast-client "" "clientAuth"
chmod 0644 "$dir"/*.pem
identities=("${@:-daemon}")
summary="ca.pem/.key"
for name in "${identities[@]}" client; do summary+=", $name.pem/.key"; done
echo "certificates in $dir: $summary"
