"""Delay (and drop) a network namespace's packets in user space: tc netem for a kernel without sch_netem.

slurm/dev/net.sh starts it inside a node's namespace, whose iptables send every packet through eth0 (in and
out) to NFQUEUE QUEUE (with --queue-bypass: if this process is gone, packets pass). Each packet is accepted
DELAY_MS after it arrived, in order, or dropped with probability LOSS_PERCENT/100. Standard library only:
nfnetlink_queue spoken over a raw netlink socket, packet metadata only (no payload copied).

    python3 netdelay.py QUEUE DELAY_MS LOSS_PERCENT
"""

from __future__ import annotations

import collections
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(msg_type: int, queue: int, attrs: bytes) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    kind = (NFNL_SUBSYS_QUEUE << 8) | msg_type
    return struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST, 0, 0) + body


def _packet_ids(data: bytes) -> list[int]:
    """The packet ids of every NFQNL_MSG_PACKET in one netlink read."""
    ids, offset = [], 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            pos, end = offset + 20, offset + length  # after nlmsghdr (16) and nfgenmsg (4)
            while pos + 4 <= end:
                attr_len, attr_type = struct.unpack_from("=HH", data, pos)
                if attr_len < 4:
                    break
                if attr_type & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                pos += (attr_len + 3) & ~3
        elif kind == NLMSG_ERROR and struct.unpack_from("=i", data, offset + 16)[0] != 0:
            sys.exit(
                f"netdelay: the kernel refused a request (errno {-struct.unpack_from('=i', data, offset + 16)[0]})"
            )
        offset += (length + 3) & ~3
    return ids


def main(queue: int, delay_s: float, loss: float) -> None:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    bind = struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, socket.AF_INET)
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, bind)))
    params = struct.pack("!IB", 0, NFQNL_COPY_META)
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_PARAMS, params)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    held: collections.deque[tuple[float, int]] = collections.deque()
    draw = random.Random()
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, packet = held.popleft()
            verdict = NF_DROP if loss and draw.random() * 100 < loss else NF_ACCEPT
            sock.send(
                _message(
                    NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet))
                )
            )
        wait = max(0.0, held[0][0] - now) if held else None
        if select.select([sock], [], [], wait)[0]:
            arrived = time.monotonic()
            held.extend((arrived + delay_s, packet) for packet in _packet_ids(sock.recv(1 << 16)))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]) / 1000, float(sys.argv[3]))
