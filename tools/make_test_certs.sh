#!/usr/bin/env bash
# Makes the certificates the TLS tests use, with Debian's openssl, into DIR (created):
#   ca.pem/.key            a test CA                    other-ca.pem/.key  an unrelated CA
#   server.pem/.key        from ca, for 127.0.0.1 and localhost (also usable as a client certificate)
#   client.pem/.key        from ca                      client-other.pem   the same key, from other-ca
#   client-expired.pem     from ca, valid only on 2020-01-01
#   server-expired.pem     from ca, for 127.0.0.1, valid only on 2020-01-01
# Certificates for tests and a local trial only: two days' validity, keys unencrypted.
#
#   tools/make_test_certs.sh DIR
set -euo pipefail
dir=${1:?usage: make_test_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
exec > make.log 2>&1
# EC keys: quick to make. `openssl ca` for the expired ones: `openssl x509` takes no start date.
key() { openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -subj "/CN=$2" "${@:3}"; }
key ca bertshard-test-ca -x509 -days 2 -out ca.pem
key other-ca other-ca -x509 -days 2 -out other-ca.pem
key server localhost -out server.csr
key client client -out client.csr
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > san.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext -out server.pem
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out client.pem
openssl x509 -req -in client.csr -CA other-ca.pem -CAkey other-ca.key -CAcreateserial -days 2 -out client-other.pem
printf '[ca]\ndefault_ca=t\n[t]\ndatabase=index.txt\nnew_certs_dir=.\nserial=serial\ndefault_md=sha256\npolicy=p\n[p]\ncommonName=supplied\n' > ca.cnf
: > index.txt
echo 01 > serial
openssl ca -batch -config ca.cnf -cert ca.pem -keyfile ca.key -in client.csr -notext \
  -startdate 20200101000000Z -enddate 20200102000000Z -out client-expired.pem
openssl ca -batch -config ca.cnf -cert ca.pem -keyfile ca.key -in server.csr -extfile san.ext -notext \
  -startdate 20200101000000Z -enddate 20200102000000Z -out server-expired.pem
