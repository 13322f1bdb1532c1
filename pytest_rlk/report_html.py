"""``report.html``: the run report's Markdown as one self-contained HTML page (PNG charts inlined
as base64), the form CI systems publish as an artifact.

Renders the Markdown subset :mod:`pytest_rlk.report` writes: headings, paragraphs, ``-`` lists
(with indented code fences), pipe tables, fenced code, an image line followed by an ``*caption*``
line (a figure), and inline code, bold and italics. No dependency beyond the standard library.
"""
from __future__ import annotations

import base64
import html
import re
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { border-bottom: 2px solid #ddd; } h2 { border-bottom: 1px solid #eee; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } tr.regression td, tr.fail td { background: #fde8e8; }
code, pre { background: #f6f6f6; font-size: 0.85em; } pre { padding: 0.5em; overflow-x: auto; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
"""
_IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<src>[^)]+)\)$")
_BAD_VERDICTS = ("regression", "missing_metric", "gate error", "FAIL")


def _inline(text: str) -> str:
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"(?<![\w*])\*([^*]+)\*(?![\w*])", r"<em>\1</em>", out)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> str:
    head, body = _cells(lines[0]), [_cells(line) for line in lines[2:]]
    rows = []
    for cells in body:
        row = '<tr class="regression">' if any(c in _BAD_VERDICTS for c in cells) else "<tr>"
        rows.append(row + "".join(f"<td>{_inline(c)}</td>" for c in cells) + "</tr>")
    return ("<table><thead><tr>" + "".join(f"<th>{_inline(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _image(src: str, alt: str, base: Path) -> str:
    path = base / src
    if path.suffix.lower() != ".png" or not path.is_file():
        return f'<p>(missing image {html.escape(src)})</p>'
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


def render_html(markdown: str, base: Path, *, title: str) -> str:
    """The page for ``markdown``; images are read from ``base`` and inlined."""
    lines = markdown.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
            i += 1
        elif line.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            out.append("<pre>" + html.escape("\n".join(lines[i + 1:end])) + "</pre>")
            i = end + 1
        elif line.startswith("|"):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("|")), len(lines))
            out.append(_table(lines[i:end]))
            i = end
        elif _IMAGE.match(line):
            found = _IMAGE.match(line)
            caption, i = "", i + 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            if i < len(lines) and lines[i].startswith("*") and not lines[i].startswith("**"):
                caption, i = lines[i].strip("*"), i + 1
            out.append(f"<figure>{_image(found['src'], found['alt'], base)}"
                       f"<figcaption>{_inline(caption)}</figcaption></figure>")
        elif line.startswith("- "):
            items: list[str] = []
            while i < len(lines) and (lines[i].startswith("- ") or lines[i].startswith("  ") or not lines[i].strip()):
                if lines[i].startswith("- "):
                    items.append(_inline(lines[i][2:]))
                    i += 1
                elif lines[i].strip().startswith("```"):
                    end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
                    code = "\n".join(x[2:] if x.startswith("  ") else x for x in lines[i + 1:end])
                    items[-1] += "<pre>" + html.escape(code) + "</pre>"
                    i = end + 1
                elif not lines[i].strip():
                    nxt = next((lines[j] for j in range(i, len(lines)) if lines[j].strip()), "")
                    if not (nxt.startswith("- ") or nxt.startswith("  ")):
                        break
                    i += 1
                else:
                    items[-1] += " " + _inline(lines[i].strip())
                    i += 1
            out.append("<ul>" + "".join(f"<li>{item}</li>" for item in items) + "</ul>")
        else:
            end = next((j for j in range(i, len(lines)) if not lines[j].strip() or lines[j].startswith(("#", "|", "- ", "```"))),
                       len(lines))
            text = " ".join(x.strip() for x in lines[i:end])
            cls = ' class="fail"' if text.startswith(("**FAIL", "**INCOMPLETE")) else ""
            out.append(f"<p{cls}>{_inline(text)}</p>")
            i = max(end, i + 1)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")


def write_html(markdown: str, base: Path, path: Path, *, title: str) -> Path:
    path.write_text(render_html(markdown, base, title=title), encoding="utf-8")
    return path
