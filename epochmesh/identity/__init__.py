"""Identities and TLS for every epochmesh program: certificates, join tokens, identity files, gRPC credentials, enrollment, login codes. May import: epochmesh.fsutil, epochmesh.grpc_util, epochmesh.v1.

The public API is re-exported here (`from epochmesh import identity as idm`, ``idm.Identity``);
the modules hold one concern each: `x509` (keys, certificates, CSRs, principals), `tokens`,
`credentials` (`Identity` and its files), `bootstrap` (fetching the CA), `grpc_auth` (channel
and server credentials, call signatures), `enroll` (enrollment and renewal calls) and `login`.

Trust model (see DESIGN.md section 6 and docs/trust.md):

- The coordinator owns a certificate authority: an EC P-256 key and a self-signed CA
  certificate in its data dir (``ca.pem`` / ``ca.key``, 0600). It serves TLS with a server
  certificate of its own key (``server.pem`` / ``server.key``) issued by that CA, and sends the
  CA certificate along in the handshake, so a newcomer that knows only the CA's fingerprint
  (from its join token) can read the chain off the handshake (`fetch_server_chain`, no trust
  needed yet), pick the certificate whose SHA-256 the token names (`fetch_ca`) and from then on
  use it as its only root. (Data dirs of older versions served the CA certificate itself;
  `fetch_ca` accepts both.) Clients verify the server under the fixed name `COORDINATOR_NAME`
  (``grpc.ssl_target_name_override``), which the server certificate always carries, so the
  address one dials (an IP, a NAT'd name) does not matter: pinning the CA is what
  authenticates the coordinator.
- Everyone else holds a key pair made locally and a certificate issued by that CA through
  enrollment (CSR + join token): subject CN = principal id, OU = role, plus SAN DNS:<principal>
  so that peers can verify "this is node X" (`peer_channel_options`). Its lifetime is the join
  token's (bounded by the coordinator); the holder renews it with its current certificate
  (`renew_identity`) once `RENEWAL_OPENS_AT` of its lifetime has passed.
- Calls to the coordinator carry the certificate as call credentials (`CertificateAuth`):
  gRPC's Python server can either require a TLS client certificate on every connection or
  not ask for one at all, and enrollment, health checks and reflection must work without
  one. So the coordinator's TLS authenticates the server only, and each call sends the
  caller's certificate (DER) plus an ECDSA signature by its key over the method name and a
  timestamp, inside that TLS session; the coordinator verifies both (coordinator/trust/auth.py).
  Between peers (PeerService) it is plain mutual TLS (`peer_server_credentials`).
- A join token is ``emt1.<secret>.<ca-fingerprint>``; the coordinator stores only the
  SHA-256 of the secret (`hash_secret`).
"""

from __future__ import annotations

from epochmesh.identity.bootstrap import fetch_ca as fetch_ca
from epochmesh.identity.bootstrap import fetch_server_certificate as fetch_server_certificate
from epochmesh.identity.bootstrap import fetch_server_chain as fetch_server_chain
from epochmesh.identity.bootstrap import split_address as split_address
from epochmesh.identity.credentials import CA_FILE as CA_FILE
from epochmesh.identity.credentials import CERT_FILE as CERT_FILE
from epochmesh.identity.credentials import KEY_FILE as KEY_FILE
from epochmesh.identity.credentials import Identity as Identity
from epochmesh.identity.credentials import IdentityFollower as IdentityFollower
from epochmesh.identity.enroll import enroll_with_token as enroll_with_token
from epochmesh.identity.enroll import renew_identity as renew_identity
from epochmesh.identity.grpc_auth import AUTH_CERT_KEY as AUTH_CERT_KEY
from epochmesh.identity.grpc_auth import AUTH_MAX_SKEW_MS as AUTH_MAX_SKEW_MS
from epochmesh.identity.grpc_auth import AUTH_SIG_KEY as AUTH_SIG_KEY
from epochmesh.identity.grpc_auth import AUTH_SIGNATURE_REUSE_MS as AUTH_SIGNATURE_REUSE_MS
from epochmesh.identity.grpc_auth import AUTH_TS_KEY as AUTH_TS_KEY
from epochmesh.identity.grpc_auth import CallSigner as CallSigner
from epochmesh.identity.grpc_auth import CertificateAuth as CertificateAuth
from epochmesh.identity.grpc_auth import Metadata as Metadata
from epochmesh.identity.grpc_auth import auth_interceptors as auth_interceptors
from epochmesh.identity.grpc_auth import auth_payload as auth_payload
from epochmesh.identity.grpc_auth import channel_credentials as channel_credentials
from epochmesh.identity.grpc_auth import coordinator_channel_options as coordinator_channel_options
from epochmesh.identity.grpc_auth import (
    coordinator_server_credentials as coordinator_server_credentials,
)
from epochmesh.identity.grpc_auth import identity_credentials as identity_credentials
from epochmesh.identity.grpc_auth import peer_aio_channel as peer_aio_channel
from epochmesh.identity.grpc_auth import peer_channel_credentials as peer_channel_credentials
from epochmesh.identity.grpc_auth import peer_channel_options as peer_channel_options
from epochmesh.identity.grpc_auth import peer_principal as peer_principal
from epochmesh.identity.grpc_auth import peer_server_credentials as peer_server_credentials
from epochmesh.identity.grpc_auth import principal_from_context as principal_from_context
from epochmesh.identity.grpc_auth import secure_aio_channel as secure_aio_channel
from epochmesh.identity.grpc_auth import secure_sync_channel as secure_sync_channel
from epochmesh.identity.grpc_auth import verify_call_signature as verify_call_signature
from epochmesh.identity.login import LOGIN_CODE_METHOD as LOGIN_CODE_METHOD
from epochmesh.identity.login import LOGIN_CODE_PREFIX as LOGIN_CODE_PREFIX
from epochmesh.identity.login import make_login_code as make_login_code
from epochmesh.identity.login import parse_login_code as parse_login_code
from epochmesh.identity.tokens import TOKEN_PREFIX as TOKEN_PREFIX
from epochmesh.identity.tokens import hash_secret as hash_secret
from epochmesh.identity.tokens import new_token as new_token
from epochmesh.identity.tokens import parse_token as parse_token
from epochmesh.identity.x509 import CA_VALIDITY_DAYS as CA_VALIDITY_DAYS
from epochmesh.identity.x509 import CERT_VALIDITY_DAYS as CERT_VALIDITY_DAYS
from epochmesh.identity.x509 import CLOCK_SKEW_S as CLOCK_SKEW_S
from epochmesh.identity.x509 import COORDINATOR_NAME as COORDINATOR_NAME
from epochmesh.identity.x509 import RENEW_AT as RENEW_AT
from epochmesh.identity.x509 import RENEWAL_OPENS_AT as RENEWAL_OPENS_AT
from epochmesh.identity.x509 import ROLE_NODE as ROLE_NODE
from epochmesh.identity.x509 import ROLE_OPERATOR as ROLE_OPERATOR
from epochmesh.identity.x509 import ROLE_SUBMITTER as ROLE_SUBMITTER
from epochmesh.identity.x509 import ROLES as ROLES
from epochmesh.identity.x509 import SERVER_CERT_VALIDITY_DAYS as SERVER_CERT_VALIDITY_DAYS
from epochmesh.identity.x509 import IdentityError as IdentityError
from epochmesh.identity.x509 import Principal as Principal
from epochmesh.identity.x509 import certificate_hosts as certificate_hosts
from epochmesh.identity.x509 import check_csr as check_csr
from epochmesh.identity.x509 import check_principal as check_principal
from epochmesh.identity.x509 import create_ca as create_ca
from epochmesh.identity.x509 import create_csr as create_csr
from epochmesh.identity.x509 import create_server_certificate as create_server_certificate
from epochmesh.identity.x509 import fingerprint as fingerprint
from epochmesh.identity.x509 import issued_and_expires_s as issued_and_expires_s
from epochmesh.identity.x509 import key_matches_certificate as key_matches_certificate
from epochmesh.identity.x509 import load_certificate as load_certificate
from epochmesh.identity.x509 import load_key as load_key
from epochmesh.identity.x509 import new_private_key as new_private_key
from epochmesh.identity.x509 import principal_from_pem as principal_from_pem
from epochmesh.identity.x509 import principal_of as principal_of
from epochmesh.identity.x509 import renewal_due_s as renewal_due_s
from epochmesh.identity.x509 import renewal_opens_s as renewal_opens_s
from epochmesh.identity.x509 import sign_csr as sign_csr
from epochmesh.identity.x509 import verify_issued_by as verify_issued_by

__all__ = [
    "ROLE_NODE",
    "ROLE_SUBMITTER",
    "ROLE_OPERATOR",
    "ROLES",
    "COORDINATOR_NAME",
    "CA_VALIDITY_DAYS",
    "CERT_VALIDITY_DAYS",
    "SERVER_CERT_VALIDITY_DAYS",
    "RENEWAL_OPENS_AT",
    "RENEW_AT",
    "CLOCK_SKEW_S",
    "IdentityError",
    "new_private_key",
    "load_key",
    "load_certificate",
    "create_ca",
    "create_server_certificate",
    "key_matches_certificate",
    "certificate_hosts",
    "create_csr",
    "check_csr",
    "check_principal",
    "sign_csr",
    "issued_and_expires_s",
    "renewal_opens_s",
    "renewal_due_s",
    "Principal",
    "principal_of",
    "principal_from_pem",
    "fingerprint",
    "verify_issued_by",
    "TOKEN_PREFIX",
    "new_token",
    "parse_token",
    "hash_secret",
    "CA_FILE",
    "CERT_FILE",
    "KEY_FILE",
    "Identity",
    "IdentityFollower",
    "split_address",
    "fetch_server_chain",
    "fetch_server_certificate",
    "fetch_ca",
    "channel_credentials",
    "AUTH_CERT_KEY",
    "AUTH_SIG_KEY",
    "AUTH_TS_KEY",
    "AUTH_MAX_SKEW_MS",
    "AUTH_SIGNATURE_REUSE_MS",
    "Metadata",
    "auth_payload",
    "CallSigner",
    "CertificateAuth",
    "auth_interceptors",
    "verify_call_signature",
    "identity_credentials",
    "peer_channel_credentials",
    "coordinator_channel_options",
    "coordinator_server_credentials",
    "peer_server_credentials",
    "peer_channel_options",
    "peer_aio_channel",
    "principal_from_context",
    "peer_principal",
    "secure_sync_channel",
    "secure_aio_channel",
    "enroll_with_token",
    "renew_identity",
    "LOGIN_CODE_PREFIX",
    "LOGIN_CODE_METHOD",
    "make_login_code",
    "parse_login_code",
]
