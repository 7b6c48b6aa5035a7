import sys, zipfile, os, glob, re
for whl in sorted(glob.glob('/tmp/sglang-wheels/sglang-*.whl')):
    v = os.path.basename(whl).split('-')[1]
    out = f'/tmp/sglang-src/{v}'
    if os.path.exists(out + '/.done'):
        continue
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if (n.startswith('sglang/srt/') and n.endswith('.py')) or n == 'sglang/launch_server.py' or n.endswith('.dist-info/METADATA') or n.endswith('.dist-info/entry_points.txt'):
                p = os.path.join(out, n)
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, 'wb') as f:
                    f.write(z.read(n))
    open(out + '/.done', 'w').write(os.path.basename(whl))
    print('extracted', v, os.path.basename(whl))
