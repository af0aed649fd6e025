#!/usr/bin/env python3
"""Structure check for src/ (issue 23), run by hsm-fixtures/test.sh.

Prints the measures the structure rounds track and fails (exit 1) when:
  - a function in src/ is longer than 80 lines (from its `fn` line to its closing brace,
    test modules left out), or longer than 60 in src/proxy/ and src/approver/, or the proxy's
    assembly (`proxy::start::run`) is longer than 40;
  - an import runs against the layering in docs/ARCHITECTURE.md
    (base → key → pki → exec → lifecycle → proxy → cli; nothing imports `cli`);
  - two modules import each other, directly or around a longer loop (modules are compared
    at the level below their nearest common parent, so `key::attestation` → `key::tpm::evidence`
    counts as `key::attestation` → `key::tpm`); a folder's own `mod.rs` is a node of that
    loop too: a child importing an item *defined* in its parent's `mod.rs` (a climb; a
    re-export is not one) and `mod.rs` using that child (relative paths count) is a cycle;
  - the proxy's children climb to items of `proxy/mod.rs` more than twice;
  - a function returns `Result<_, String>`, or 20 or more `reason: String` fields remain;
  - a comment in src/ names an issue by its number ("issue 38"): the history is in git and
    docs/BENCHMARKS.md, and a comment says what the code does and why;
  - src/proxy/start.rs, the proxy's assembly, holds more than 200 lines (components build
    themselves; it only orders them);
  - a file in src/ holds more than 600 lines without its tests, unless OVER_BUDGET lists it
    with the reason (and a listed file that fits the budget again fails too, so the list
    only shrinks);
  - two modules of a bench import each other (benches/ is checked for cycles like src/);
  - two public functions in src/ share a name, unless ROLES names it with the one thing every
    function of that name does (each backend's `sign`, each command's `run`).

It reads the code after stripping comments, strings and character literals, so braces and
paths inside them do not count. Usage: python3 hsm-fixtures/structure.py [--verbose]
"""
import os
import re
import sys

MAX_FN_LINES = 80
# Where functions must be shorter (the two busiest rooms), and the proxy's assembly.
TIGHT_FOLDERS = {"proxy": 60, "approver": 60}
ASSEMBLY = ("src/proxy/start.rs", "run", 40)
MAX_PROXY_CLIMBS = 2
MAX_REASON_STRING = 19
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? \d+")
# Names several public functions may share because each does the same thing for its own part
# (a backend, a command, a policy): the one thing, which a reader can check.
ROLES = {
    "run": "a command's or a component's entry point",
    "judge": "an approver policy's reading of a request by itself",
    "settle": "an approver policy's decision against the trust (and its dispatch)",
    "activate": "TPM2_ActivateCredential, dispatched by the key layer to the TPM backend",
    "enroll": "a TPM's enrollment (EK, AK), dispatched by the key layer to the TPM backend",
    "create": "a new key (or request) in its backend, dispatched by the key layer",
    "delete": "a key deleted from its backend, dispatched by the key layer",
    "list": "the keys a backend holds, dispatched by the key layer",
    "open": "a key opened in its backend, dispatched by the key layer",
    "store_chain": "a certificate chain stored beside a key in its backend",
    "sign": "a signature made inside a backend's hardware",
    "parse": "one kind of key URI read (pkcs11:, tpm:)",
    "serve": "a listener's accept loop",
    "connect": "a tunnel opened through an egress proxy of one kind",
    "attribute": "the PKCS#10 attribute carrying one kind of hardware proof",
    "public_spki": "a backend's public key object as a SubjectPublicKeyInfo",
    "ec_spki": "an EC point as a SubjectPublicKeyInfo, from DER or from a TPM public area",
    "facts_of": "what a request proves, read for the approver",
    "admit": "a request's evidence admitted against the registered AKs",
}

# Lines a file in src/ may hold without its tests.
MAX_FILE_LINES = 600
# The proxy's assembly only orders the components, which build themselves: a small file.
ASSEMBLY_FILE_LINES = 200
# The files over that budget, each with why it is not split yet. Nothing is added here without
# a reason a reader can check; a file that fits again must leave the list.
OVER_BUDGET = {
    "src/proxy/settings.rs": "every proxy setting's type with its check, one per field, the "
        "one settings type every component takes",
    "src/signer/remote.rs": "the signer's client side: the protocol, the reconnecting "
        "session and the rustls/rcgen adapters over it",
    "src/proxy/metrics.rs": "every metric family the proxy exports, with its help text",
    "src/proxy/admin.rs": "the admin listener's routes (metrics, healthz, readyz, reload)",
    "src/key/pkcs11/mod.rs": "the PKCS#11 backend's key operations (create, find, list, "
        "delete, store chain) over one session pool",
    "src/kubeconfig.rs": "the kubeconfig model and its hwkey extension, read and written",
    "src/approver/trust.rs": "the trust sources (directory, ConfigMap), their following and "
        "the binding record, which share one reading type",
    "src/proxy/renewal.rs": "the proxy's renewal loop, its hot swap and its proof of the "
        "new certificate",
}

# Each top-level module of the library and the layer it belongs to: a module may import from
# its own layer's modules only where listed below as allowed, and from any lower layer.
LAYERS = {
    # The base: small helpers every layer may use.
    "atomic_file": 0, "small_file": 0, "state_dir": 0, "duration": 0, "hex": 0,
    "backoff": 0, "http_serve": 0, "endpoint": 0, "error_chain": 0, "stop": 0,
    "serde_text": 0, "metric_labels": 0,
    "key": 1,
    "pki": 2,
    # What the exec plugin and the proxy share: the kubeconfig (its hwkey extension, written by
    # the generator) and the control socket's protocol.
    "kubeconfig": 3, "control_api": 3, "egress": 3, "signer": 3,
    "exec": 4,
    "lifecycle": 5, "approver": 5,
    "proxy": 6, "probe": 6,
    "cli": 7,
}
# Imports allowed between modules of one layer (importer, imported).
SAME_LAYER = {("probe", "proxy"), ("http_serve", "small_file"), ("state_dir", "atomic_file"),
              ("http_serve", "duration"), ("serde_text", "duration")}


def strip(text):
    """Replaces comments, string and char literals with spaces, keeping newlines."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif (m := re.match(r'b?r(#*)"', text[i:i + 300])) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = '"' + m.group(1)
            j = text.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'", text[i:i + 12])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:  # a lifetime or a label
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(code, open_at):
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def without_tests(code):
    """Blanks `#[cfg(test)]` items (test modules and test-only functions), keeping lines."""
    for m in reversed(list(re.finditer(r"#\[cfg\(test\)\]", code))):
        brace = code.find("{", m.end())
        semi = code.find(";", m.end())
        if brace < 0 or (0 <= semi < brace):
            end = semi
        else:
            end = matching_brace(code, brace)
        code = code[:m.start()] + re.sub(r"[^\n]", " ", code[m.start():end + 1]) + code[end + 1:]
    return code


def functions(code):
    """Yields (name, first line, line count) for every function with a body."""
    for m in re.finditer(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)", code):
        # The body is the first `{` after the signature outside parentheses and generics.
        depth, j = 0, m.end()
        while j < len(code):
            c = code[j]
            if c in "(<[":
                depth += 1
            elif c in ")>]":
                if not (c == ">" and code[j - 1] == "-"):
                    depth -= 1
            elif c == ";" and depth <= 0:
                j = -1
                break
            elif c == "{" and depth <= 0:
                break
            j += 1
        if j < 0 or j >= len(code):
            continue
        end = matching_brace(code, j)
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, end) + 1
        yield m.group(1), first, last - first + 1


def module_of(path):
    rel = os.path.relpath(path, "src")[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return rel


def result_string(code):
    """Counts `Result<…, String>` types."""
    count = 0
    for m in re.finditer(r"\bResult<", code):
        depth, j, last_arg = 1, m.end(), m.end()
        while j < len(code) and depth:
            c = code[j]
            if c == "<":
                depth += 1
            elif c == ">" and code[j - 1] != "-":
                depth -= 1
            elif c == "," and depth == 1:
                last_arg = j + 1
            j += 1
        if code[last_arg:j - 1].strip() == "String" and last_arg != m.end():
            count += 1
    return count


def paths(code, module, modules=frozenset()):
    """Yields every module path this file refers to (`crate::…`, `super::…`, `use` groups), and
    the paths relative to this module that name one of its child modules (`mod.rs` writes
    `listener::accept_loop`)."""
    for m in re.finditer(r"\buse\s+([^;]+);", code):
        yield from expand_use(m.group(1).replace("\n", " "), module, modules=modules)
    for m in re.finditer(r"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:::(?:super|[A-Za-z_][A-Za-z0-9_]*))+)", code):
        yield resolve(m.group(1).split("::"), module)
    for m in re.finditer(r"(?<![A-Za-z0-9_:])([a-z_][a-z0-9_]*)((?:::[A-Za-z_][A-Za-z0-9_]*)+)", code):
        head = m.group(1)
        if tuple(module) + (head,) in modules:
            yield list(module) + [head] + [p for p in m.group(2).split("::") if p]


def expand_use(tree, module, prefix=(), modules=frozenset()):
    tree = tree.strip()
    if tree.startswith("pub"):
        tree = re.sub(r"^pub(\([^)]*\))?\s+", "", tree)
    brace = tree.find("{")
    if brace < 0:
        parts = [p.strip() for p in tree.split(" as ")[0].split("::") if p.strip()]
        full = list(prefix) + parts
        if full and full[0] in ("crate", "super", "self"):
            yield resolve(full, module)
        elif full and tuple(module) + (full[0],) in modules:
            yield list(module) + full
        return
    head = [p for p in tree[:brace].split("::") if p.strip()]
    inner = tree[brace + 1:tree.rfind("}")]
    depth, start = 0, 0
    for k, c in enumerate(inner + ","):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            part = inner[start:k]
            start = k + 1
            if part.strip():
                yield from expand_use(part, module, tuple(prefix) + tuple(h.strip() for h in head), modules)


def resolve(parts, module):
    here = list(module)
    out = []
    for k, p in enumerate(parts):
        if k == 0 and p == "crate":
            here = []
        elif p == "super" and not out:
            here = here[:-1]
        elif p == "self" and not out:
            pass
        else:
            out.append(p)
    return here + out


def main():
    verbose = "--verbose" in sys.argv
    failures = []
    long_fns, reason_strings, result_strings, cfg_features = [], 0, 0, 0
    issue_numbers = []
    files = {}
    over_budget = []
    assembly_lines = 0
    for root, _, names in os.walk("src"):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                code = without_tests(strip(text))
                files[path] = code
                test_lines = sum(1 for a, b in zip(strip(text).splitlines(), code.splitlines()) if a.strip() and not b.strip())
                lines = len(text.splitlines()) - test_lines
                if lines > MAX_FILE_LINES:
                    over_budget.append((lines, path))
                if path == ASSEMBLY[0]:
                    assembly_lines = lines
                for number, line in enumerate(text.splitlines(), 1):
                    comment = line.split("//", 1)[1] if "//" in line else ""
                    if ISSUE_NUMBER.search(comment):
                        issue_numbers.append(f"{path}:{number}")
    modules = frozenset(tuple(module_of(p)) for p in files)
    file_of = {tuple(module_of(p)): p for p in files}
    edges = {}
    # (folder, child module that climbs, item of the folder's mod.rs)
    climbs, reexport_climbs = set(), set()
    for path, code in sorted(files.items()):
        top = module_of(path)[0] if module_of(path) else ""
        limit = TIGHT_FOLDERS.get(top, MAX_FN_LINES)
        for name, line, length in functions(code):
            if (path, name) == ASSEMBLY[:2]:
                limit_here = ASSEMBLY[2]
            else:
                limit_here = limit
            if length > limit_here:
                long_fns.append((length, f"{path}:{line}", f"{name} (at most {limit_here})"))
        # Fields, not closure parameters (`|reason: String|`).
        reason_strings += len(re.findall(r"\breason:\s*String\s*[,}\n]", code))
        result_strings += result_string(code)
        cfg_features += sum(1 for l in code.splitlines() if "cfg(" in l and "feature" in l)
        here = tuple(module_of(path))
        for named in paths(code, here, modules):
            # The longest known module the path names.
            target = list(named)
            while target and tuple(target) not in modules:
                target = target[:-1]
            target = tuple(target)
            if target and target != here:
                edges.setdefault(here, set()).add(target)
            # A climb: an item (not a module) of an ancestor's own file.
            if target and len(target) < len(here) and here[:len(target)] == target and len(named) > len(target):
                item = named[len(target)]
                kind = item_kind(files.get(file_of.get(target, ""), ""), item)
                if kind == "defined":
                    climbs.add((target, here[:len(target) + 1], item))
                elif kind == "reexport":
                    reexport_climbs.add((target, here[:len(target) + 1], item))
    # Layering between top-level modules.
    layering = []
    for src, dsts in edges.items():
        if not src or src[0] == "bin":
            continue
        for dst in dsts:
            a, b = src[0], dst[0]
            if a == b:
                continue
            if b == "cli":
                layering.append(f"{'::'.join(src)} imports cli (`{'::'.join(dst)}`): nothing imports cli")
                continue
            if a not in LAYERS or b not in LAYERS:
                layering.append(f"{a} or {b} has no layer in hsm-fixtures/structure.py (add it and to docs/ARCHITECTURE.md)")
                continue
            if LAYERS[b] > LAYERS[a] or (LAYERS[b] == LAYERS[a] and (a, b) not in SAME_LAYER):
                layering.append(f"{'::'.join(src)} → {'::'.join(dst)}: {a} (layer {LAYERS[a]}) may not import {b} (layer {LAYERS[b]})")
    # Cycles between sibling modules.
    sibling = {}
    for src, dsts in edges.items():
        for dst in dsts:
            k = 0
            while k < min(len(src), len(dst)) and src[k] == dst[k]:
                k += 1
            if k == len(src) or k == len(dst):
                continue  # a module and its own parent or child
            parent = src[:k]
            sibling.setdefault(parent, {}).setdefault(src[k], set()).add(dst[k])
    # A folder's own file is a node of its loop: a climb is child → (mod), and mod.rs using a
    # child is (mod) → child.
    for folder, child, _ in climbs:
        sibling.setdefault(folder, {}).setdefault(child[-1], set()).add("(mod)")
    for src, dsts in edges.items():
        for dst in dsts:
            if len(dst) == len(src) + 1 and dst[:len(src)] == src:
                sibling.setdefault(src, {}).setdefault("(mod)", set()).add(dst[-1])
    cycles = []
    for parent, graph in sorted(sibling.items()):
        for cycle in find_cycles(graph):
            prefix = "::".join(parent) + "::" if parent else ""
            cycles.append(" → ".join(prefix + c for c in cycle))
    long_fns.sort(reverse=True)
    print(f"functions over their limit in src/ ({MAX_FN_LINES} lines; 60 in proxy and approver; 40 for the proxy's assembly): {len(long_fns)}")
    for length, where, name in long_fns:
        print(f"  {name} {length} ({where})")
    print(f"`reason: String` fields: {reason_strings} (at most {MAX_REASON_STRING})")
    print(f"functions returning Result<_, String>: {result_strings}")
    print(f"lines with cfg(feature …): {cfg_features}")
    print(f"comments naming an issue number: {len(issue_numbers)}")
    for where in issue_numbers:
        print(f"  {where}")
    print(f"imports against the layering: {len(layering)}")
    for l in sorted(set(layering)):
        print(f"  {l}")
    print(f"import cycles between modules (a folder's mod.rs included): {len(cycles)}")
    for c in cycles:
        print(f"  {c}")
    by_folder = {}
    for folder, child, item in climbs:
        by_folder.setdefault(folder, []).append(f"{'::'.join(child)} → {item}")
    print(f"climbs to an item defined in the parent's mod.rs: {len(climbs)}")
    for folder in sorted(by_folder):
        print(f"  {'::'.join(folder) or '(crate)'}: {len(by_folder[folder])}: {', '.join(sorted(by_folder[folder]))}")
    print(f"climbs to a re-export of the parent (allowed): {len(reexport_climbs)}")
    proxy_climbs = len(by_folder.get(("proxy",), []))
    if verbose:
        for src in sorted(edges):
            print("::".join(src) or "(crate)", "→", ", ".join(sorted("::".join(d) for d in edges[src])))
    if long_fns:
        failures.append(f"{len(long_fns)} functions over their limit")
    if reason_strings > MAX_REASON_STRING:
        failures.append(f"{reason_strings} `reason: String` fields")
    if result_strings:
        failures.append(f"{result_strings} Result<_, String>")
    if issue_numbers:
        failures.append(f"{len(issue_numbers)} comments naming an issue number")
    if layering:
        failures.append(f"{len(set(layering))} imports against the layering")
    if cycles:
        failures.append(f"{len(cycles)} import cycles")
    print(f"files over {MAX_FILE_LINES} lines without their tests: {len(over_budget)} ({len(OVER_BUDGET)} listed with a reason)")
    unlisted = []
    for lines, path in sorted(over_budget, reverse=True):
        reason = OVER_BUDGET.get(path, "").strip()
        print(f"  {path}: {lines}" + (f" (listed: {reason})" if reason else " (NOT LISTED)"))
        if not reason:
            unlisted.append(path)
    fits_again = sorted(set(OVER_BUDGET) - {p for _, p in over_budget})
    for path in fits_again:
        print(f"  {path}: fits the budget now: remove it from OVER_BUDGET")
    if unlisted:
        failures.append(f"{len(unlisted)} files over {MAX_FILE_LINES} lines")
    if fits_again:
        failures.append(f"{len(fits_again)} files listed in OVER_BUDGET that fit")
    print(f"{ASSEMBLY[0]}: {assembly_lines} lines (at most {ASSEMBLY_FILE_LINES}: it orders the components, which build themselves)")
    if assembly_lines > ASSEMBLY_FILE_LINES:
        failures.append(f"{ASSEMBLY[0]} over {ASSEMBLY_FILE_LINES} lines")
    shared = shared_names(files)
    print(f"public function names shared without a role in ROLES: {len(shared)}")
    for name, paths_ in sorted(shared.items()):
        print(f"  {name}: {', '.join(paths_)}")
    if shared:
        failures.append(f"{len(shared)} public function names shared by different things")
    bench_cycles = benches_cycles()
    print(f"import cycles between modules of a bench: {len(bench_cycles)}")
    for c in bench_cycles:
        print(f"  {c}")
    if bench_cycles:
        failures.append(f"{len(bench_cycles)} import cycles in benches/")
    if proxy_climbs > MAX_PROXY_CLIMBS:
        failures.append(f"{proxy_climbs} climbs from proxy's children to proxy/mod.rs (at most {MAX_PROXY_CLIMBS})")
    if failures:
        print("structure.py: FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    print("structure.py: ok")
    return 0


def shared_names(files):
    """Public free functions (not methods) whose name appears in more than one file and has no
    role in ROLES."""
    seen = {}
    for path, code in files.items():
        for m in re.finditer(r"^pub(?:\([a-z]+\))?\s+(?:async\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)", code, re.M):
            seen.setdefault(m.group(1), set()).add(path)
    return {n: sorted(p) for n, p in seen.items() if len(p) > 1 and n not in ROLES}


def benches_cycles():
    """Cycles between the modules of each bench binary (a folder such as benches/e2e/ is one
    binary; its main.rs is the crate root)."""
    out = []
    for entry in sorted(os.listdir("benches")):
        folder = os.path.join("benches", entry)
        if not os.path.isdir(folder):
            continue
        files = {}
        for name in os.listdir(folder):
            if name.endswith(".rs"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    files[name[:-3]] = without_tests(strip(f.read()))
        modules = frozenset((m,) for m in files if m != "main")
        graph = {}
        for name, code in files.items():
            if name == "main":
                continue
            for named in paths(code, (name,), modules):
                target = tuple(named[:1])
                if target in modules and target != (name,):
                    graph.setdefault(name, set()).add(target[0])
        for cycle in find_cycles(graph):
            out.append(" → ".join(f"{entry}::{c}" for c in cycle))
    return out


def item_kind(code, name):
    """Whether `name` is defined in this file's own code ("defined"), only re-exported by a
    `pub use` ("reexport"), or neither (a module, a macro, or not found)."""
    if not code:
        return None
    defined = re.search(
        r"\b(?:struct|enum|fn|type|const|static|trait|union)\s+" + re.escape(name) + r"\b", code)
    if defined:
        return "defined"
    for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", code):
        if re.search(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])", m.group(1)):
            return "reexport"
    return None


def find_cycles(graph):
    """Strongly connected components with more than one module, as readable loops."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.exit(main())
