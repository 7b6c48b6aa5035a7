"""Static resolution of dotted targets against an extracted sglang release."""
import ast, os, sys, json, functools

ROOT = None  # /tmp/sglang-src/X

def set_root(r):
    global ROOT
    ROOT = r
    _parse.cache_clear()

def mod_file(mod):
    base = os.path.join(ROOT, *mod.split('.'))
    for p in (base + '.py', os.path.join(base, '__init__.py')):
        if os.path.exists(p):
            return p
    return None

@functools.lru_cache(None)
def _parse(path):
    with open(path, encoding='utf-8') as f:
        return ast.parse(f.read())

def rel(path):
    return os.path.relpath(path, ROOT)

def top_names(mod):
    """name -> (kind, node, path) for module top level, incl imports (kind=import, target)."""
    path = mod_file(mod)
    tree = _parse(path)
    names = {}
    def visit(body):
        for n in body:
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.setdefault(n.name, ('def', n, path))
            elif isinstance(n, ast.Assign):
                for t in n.targets:
                    for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(e, ast.Name):
                            names.setdefault(e.id, ('assign', n, path))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.setdefault(n.target.id, ('assign', n, path))
            elif isinstance(n, ast.ImportFrom) and any(a.name == '*' for a in n.names):
                names.setdefault('*', []).append(n.module)
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ''
                if n.level:
                    pkg = mod.split('.')
                    if not path.endswith('__init__.py'):
                        pkg = pkg[:-1]
                    pkg = pkg[: len(pkg) - (n.level - 1)]
                    base = '.'.join(pkg + ([n.module] if n.module else []))
                for a in n.names:
                    names.setdefault(a.asname or a.name, ('import', f'{base}.{a.name}', path, n))
            elif isinstance(n, ast.Import):
                for a in n.names:
                    names.setdefault(a.asname or a.name.split('.')[0], ('importmod', a.name, path, n))
            elif isinstance(n, (ast.If, ast.Try)):
                visit(n.body)
                for h in getattr(n, 'handlers', []):
                    visit(h.body)
                visit(getattr(n, 'orelse', []))
                visit(getattr(n, 'finalbody', []))
    visit(tree.body)
    return names

def resolve_name(mod, name, depth=0):
    """Follow imports: returns (kind, node, path, mod) of a top-level def/assign, or None."""
    if depth > 8 or mod_file(mod) is None:
        # maybe mod.name is a submodule
        return None
    names = top_names(mod)
    if name not in names:
        for star in names.get('*', []):
            r = resolve_name(star, name, depth + 1)
            if r: return r
        sub = f'{mod}.{name}'
        if mod_file(sub):
            return ('module', None, mod_file(sub), sub)
        return None
    e = names[name]
    if e[0] == 'import':
        tgt = e[1]
        m, _, nm = tgt.rpartition('.')
        if mod_file(tgt):
            return ('module', None, mod_file(tgt), tgt)
        if not tgt.startswith('sglang') or mod_file(m) is None:
            return ('external', e[3], e[2], tgt)
        r = resolve_name(m, nm, depth + 1)
        return r
    if e[0] == 'importmod':
        return ('module', None, mod_file(e[1]), e[1]) if mod_file(e[1]) else None
    return (e[0], e[1], e[2], mod)

def class_members(cls_node):
    m = {}
    for n in cls_node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            m.setdefault(n.name, n)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    m.setdefault(t.id, n)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            m.setdefault(n.target.id, n)
    return m

def base_refs(cls_node, mod):
    out = []
    for b in cls_node.bases:
        if isinstance(b, ast.Name):
            out.append((mod, b.id))
        elif isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name):
            # module.Class
            nm = top_names(mod).get(b.value.id)
            if nm and nm[0] in ('importmod', 'import'):
                out.append((nm[1], b.attr))
        elif isinstance(b, ast.Subscript) and isinstance(b.value, ast.Name):
            out.append((mod, b.value.id))
    return out

def find_member(cls_node, mod, path, attr, depth=0, seen=None):
    """Search class and its bases (static MRO-ish, depth-first). -> (node, path, owner)"""
    m = class_members(cls_node)
    if attr in m:
        return m[attr], path, cls_node.name
    if depth > 10:
        return None
    for bmod, bname in base_refs(cls_node, mod):
        r = resolve_name(bmod, bname)
        if r and r[0] == 'def' and isinstance(r[1], ast.ClassDef):
            f = find_member(r[1], r[3], r[2], attr, depth + 1)
            if f:
                return f
    return None

def all_fields(cls_node, mod, path, depth=0):
    """annotated + assigned names in class body and bases: name -> (line, path, owner)"""
    out = {}
    for bmod, bname in base_refs(cls_node, mod):
        r = resolve_name(bmod, bname)
        if r and r[0] == 'def' and isinstance(r[1], ast.ClassDef) and depth < 10:
            out.update(all_fields(r[1], r[3], r[2], depth + 1))
    for k, n in class_members(cls_node).items():
        out[k] = (n.lineno, path, cls_node.name)
    return out

def split_target(dotted):
    parts = dotted.split('.')
    for i in range(len(parts), 0, -1):
        mod = '.'.join(parts[:i])
        if mod_file(mod):
            return mod, parts[i:]
    return None, parts

def params(fn):
    a = fn.args
    ps = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg: ps.append('*' + a.vararg.arg)
    ps += [x.arg for x in a.kwonlyargs]
    if a.kwarg: ps.append('**' + a.kwarg.arg)
    return ps

def fn_kind(fn):
    if isinstance(fn, ast.AsyncFunctionDef):
        has_yield = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(fn)
                        )
        return 'asyncgen' if has_yield else 'coroutine'
    if isinstance(fn, ast.FunctionDef):
        return 'function'
    return type(fn).__name__

def resolve(dotted):
    """-> dict(status, where, params, kind)"""
    mod, rest = split_target(dotted)
    if mod is None:
        return {'status': 'missing', 'why': 'no module'}
    if not rest:
        return {'status': 'ok', 'where': rel(mod_file(mod)), 'kind': 'module'}
    r = resolve_name(mod, rest[0])
    if r is None:
        return {'status': 'missing', 'why': f'{rel(mod_file(mod))} has no {rest[0]}'}
    kind, node, path, m2 = r
    rest = rest[1:]
    while rest:
        if not isinstance(node, ast.ClassDef):
            return {'status': 'missing', 'why': f'{rest[0]} under non-class'}
        f = find_member(node, m2, path, rest[0])
        if f is None:
            return {'status': 'missing', 'why': f'class {node.name} ({rel(path)}:{node.lineno}) has no {rest[0]}'}
        node, path, owner = f
        rest = rest[1:]
    d = {'status': 'ok', 'where': f'{rel(path)}:{node.lineno}' if node is not None else rel(path)}
    if kind == 'external':
        d['note'] = f'imported from {m2} (outside sglang)'
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        d['params'] = params(node)
        d['kind'] = fn_kind(node)
    return d

def fields(owner):
    mod, rest = split_target(owner)
    if mod is None:
        return None, 'no module'
    if not rest:
        names = top_names(mod)
        return {k: (getattr(v[1], 'lineno', None) if v[0] != 'import' else v[3].lineno, v[2], mod) for k, v in names.items()}, rel(mod_file(mod))
    r = resolve_name(mod, rest[0])
    if r is None or r[0] != 'def':
        return None, f'{rel(mod_file(mod))} has no class {rest[0]}'
    node, path = r[1], r[2]
    fs = all_fields(node, r[3], path)
    where = f'{rel(path)}:{node.lineno}'
    # 0.5.2x: ServerArgs fields assembled from arg_groups/fields namespaces
    tree = _parse(path)
    for n in tree.body:
        if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == '_INPUT_NAMESPACES':
            where += f' + _INPUT_NAMESPACES ({rel(path)}:{n.lineno})'
            for e in n.value.elts:
                rr = resolve_name(r[3], e.id)
                if rr and rr[0] == 'def':
                    fs.update({k: v for k, v in all_fields(rr[1], rr[3], rr[2]).items() if k not in fs})
    return fs, where
