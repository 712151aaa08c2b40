"""Bring a stored Istio golden of an older layout to the layout of Istio's current ``capture/run.go``.

The Istio goldens kept in ``golden/istio/`` are verbatim files from Istio's history
(``tools/istio-iptables/pkg/capture/testdata/*.golden``, ``cni/pkg/plugin/testdata/*.txt.golden``);
the newest stored version of a file is not always the newest Istio has. Each rewrite here stands for
one change Istio made since, so a file can be compared with our builder's output line for line:

1. command form (``iptables -t T -A ...``, before istio-iptables used iptables-restore) becomes the
   restore form per family, tables sorted, ``-N`` lines first, framed by the save commands;
2. ``-A OUTPUT -p tcp -j ISTIO_OUTPUT`` became ``-A OUTPUT -j ISTIO_OUTPUT`` (udp is shunted inside);
3. the proxy's ``-o lo`` ISTIO_IN_REDIRECT rules gained ``-p tcp ! --dport <tunnel port>``;
4. nat ISTIO_OUTPUT_DNS lost its udp/53 owner RETURN rules, and a family without a DNS rule left
   there lost its jump to the chain;
5. an excluded outbound port is excluded for udp too (a tcp then a udp rule per port);
6. a CIDR include list no longer ends ISTIO_OUTPUT with ``-j RETURN``;
7. ``-m multiport --dports a,b -j RETURN`` (Istio pull request 59544, closed unmerged) is one rule
   per port, tcp then udp for each outbound port.
"""

from __future__ import annotations

import re

SAVES = ("iptables-save", "ip6tables-save")


def to_current_layout(text: str) -> str:
    """``text`` (an Istio golden) in the current layout, ending with a newline."""
    lines = text.rstrip("\n").split("\n")
    if re.match(r"ip6?tables -t ", lines[0]):
        lines = _restore_form(lines)
    lines = [_line(line) for line in lines]
    lines = _per_port(lines)
    lines = [line for block in _blocks(lines) for line in _current_block(block)]
    return "\n".join(lines) + "\n"


def _restore_form(lines: list[str]) -> list[str]:
    tables: dict[str, dict[str, tuple[list[str], list[str]]]] = {"iptables": {}, "ip6tables": {}}
    for line in lines:
        match = re.match(r"(ip6?tables) -t (\w+) (.*)", line)
        if match is None:
            continue
        binary, table, rule = match.groups()
        chains, rules = tables[binary].setdefault(table, ([], []))
        (chains if rule.startswith("-N ") else rules).append(rule)
    out = list(SAVES)
    for binary in ("iptables", "ip6tables"):
        for table, (chains, rules) in sorted(tables[binary].items()):
            out += [f"* {table}", *chains, *rules, "COMMIT"]
    return out + (list(SAVES) if tables["ip6tables"] else [SAVES[0]])


def _line(line: str) -> str:
    if line == "-A OUTPUT -p tcp -j ISTIO_OUTPUT":
        return "-A OUTPUT -j ISTIO_OUTPUT"
    match = re.match(
        r"(-A ISTIO_OUTPUT -o lo ! -d \S+) (-m owner --[ug]id-owner \S+ -j ISTIO_IN_REDIRECT)$", line
    )
    if match is not None:
        return f"{match.group(1)} -p tcp ! --dport 15008 {match.group(2)}"
    return line


def _per_port(lines: list[str]) -> list[str]:
    out: list[str] = []
    index = 0
    while index < len(lines):
        match = re.match(r"-A (\w+) -p tcp -m multiport --dports ([\d,]+) -j RETURN$", lines[index])
        if match is None:
            out.append(lines[index])
            index += 1
            continue
        chain, ports = match.groups()
        udp = f"-A {chain} -p udp -m multiport --dports {ports} -j RETURN"
        with_udp = index + 1 < len(lines) and lines[index + 1] == udp
        for port in ports.split(","):
            out.append(f"-A {chain} -p tcp --dport {port} -j RETURN")
            if with_udp:
                out.append(f"-A {chain} -p udp --dport {port} -j RETURN")
        index += 2 if with_udp else 1
    return out


def _blocks(lines: list[str]) -> list[list[str]]:
    """The lines cut into table blocks (``* t`` .. ``COMMIT``) and single other lines."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in lines:
        if line.startswith("* "):
            current = [line]
        elif current is not None:
            current.append(line)
            if line == "COMMIT":
                blocks.append(current)
                current = None
        else:
            blocks.append([line])
    return blocks


def _current_block(block: list[str]) -> list[str]:
    if block[0] != "* nat":
        return block
    dns_return = re.compile(r"-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner .* -j RETURN$")
    kept = [line for line in block if not dns_return.match(line)]
    if "-N ISTIO_OUTPUT_DNS" in kept and not any(line.startswith("-A ISTIO_OUTPUT_DNS") for line in kept):
        kept = [
            line
            for line in kept
            if line not in ("-N ISTIO_OUTPUT_DNS", "-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS")
        ]
    out: list[str] = []
    before_bind = True
    for position, line in enumerate(kept):
        if line.startswith("-A ISTIO_OUTPUT -o lo -s "):
            before_bind = False
        if line == "-A ISTIO_OUTPUT -j RETURN" and kept[position + 1] == "COMMIT":
            continue
        out.append(line)
        match = re.match(r"-A ISTIO_OUTPUT -p tcp --dport (\d+) -j RETURN$", line)
        if match is not None and before_bind:
            udp = f"-A ISTIO_OUTPUT -p udp --dport {match.group(1)} -j RETURN"
            if kept[position + 1] != udp:
                out.append(udp)
    return out
