import re, sys
ansi = re.compile(r'\x1b\[[0-9;]*m')
pat = re.compile(r'step (\d+): engine ([\d.]+) ms.*?(\d+) decoding \((\d+) rows, (\d+) cached\), prefill \[([^\]]*)\]( mixed)?, measured ([\d.]+) ms, estimated ([\d.]+) ms')
for f in sys.argv[1:]:
    seen = set(); first = []; rep = []
    for line in open(f, errors='replace'):
        m = pat.search(ansi.sub('', line))
        if not m or not m[7]: continue
        rows = int(m[4]) + sum(int(c.split('@')[0]) for c in m[6].split())
        ratio = float(m[8]) / float(m[9])
        (rep if rows in seen else first).append((ratio, rows, m[6], float(m[8])))
        seen.add(rows)
    avg = lambda xs: sum(x[0] for x in xs) / max(1, len(xs))
    slow = lambda xs: sum(1 for x in xs if x[0] > 1.4)
    print(f, 'first-seen row counts: %d steps, mean measured/estimated %.2f, %d over 1.4x; repeated: %d steps, mean %.2f, %d over 1.4x' % (len(first), avg(first), slow(first), len(rep), avg(rep), slow(rep)))
    print('  slow repeated:', sorted(rep, reverse=True)[:5])
    print('  slow first:', sorted(first, reverse=True)[:5])
