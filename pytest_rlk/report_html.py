"""``report.html``: the run report's Markdown as one self-contained HTML page (PNG charts inlined
as base64), the form CI systems publish as an artifact.

Renders the Markdown subset :mod:`pytest_rlk.report` writes: headings (each with the anchor
GitHub gives it, :func:`anchor`), paragraphs, ``-`` and ``1.`` lists (with indented code fences),
pipe tables, fenced code, an image line followed by an ``*caption*`` line (a figure), and inline
code, bold, italics and links within the page (``[text](#anchor)``). Tables wrap their cells to
the page's width. No dependency beyond the standard library.
"""
from __future__ import annotations

import base64
import html
import re
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 1em auto; padding: 0 1em; color: #222; }
h1 { border-bottom: 2px solid #ddd; margin: 0.3em 0; font-size: 1.6em; }
h2 { border-bottom: 1px solid #eee; margin-top: 2em; }
p.verdict { font-size: 1.3em; padding: 0.4em 0.6em; border-radius: 4px; background: #e6f4ea; margin: 0.4em 0; }
p.verdict.fail { background: #fde8e8; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0; width: 100%; }
th, td { border: 1px solid #ddd; padding: 2px 5px; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; word-break: break-word; }
td.n { white-space: nowrap; overflow-wrap: normal; word-break: normal; }
th { background: #f4f4f4; overflow-wrap: normal; word-break: normal; } tr.regression td { background: #fde8e8; }
code, pre { background: #f6f6f6; font-size: 0.85em; } pre { padding: 0.5em; overflow-x: auto; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
"""
_LINK = re.compile(r"\[([^\]]+)\]\(#([\w-]+)\)")
_IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<src>[^)]+)\)$")
_BAD_VERDICTS = ("regression", "missing_metric", "gate error", "FAIL")


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, spaces to ``-``, punctuation dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _inline(text: str) -> str:
    out = html.escape(text, quote=False)
    out = _LINK.sub(r'<a href="#\2">\1</a>', out)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"(?<![\w*])\*([^*]+)\*(?![\w*])", r"<em>\1</em>", out)


_NUMBERED = re.compile(r"^\d+\. ")
_NUMBER = re.compile(r"[-+±]?\d[\d.,]*(e[+-]?\d+)?(x|%)?")  # a number cell: never broken over lines


def _item(line: str) -> str | None:
    """The text of a list item line (``- x`` or ``1. x``), else None."""
    if line.startswith("- "):
        return line[2:]
    found = _NUMBERED.match(line)
    return line[found.end():] if found else None


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> str:
    head, body = _cells(lines[0]), [_cells(line) for line in lines[2:]]
    rows = []
    for cells in body:
        row = '<tr class="regression">' if any(c in _BAD_VERDICTS for c in cells) else "<tr>"
        rows.append(row + "".join(f'<td class="n">{_inline(c)}</td>' if _NUMBER.fullmatch(c) else f"<td>{_inline(c)}</td>"
                                  for c in cells) + "</tr>")
    return ("<div><table><thead><tr>" + "".join(f"<th>{_inline(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></div>")


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
            text = line[level:].strip()
            out.append(f'<h{level} id="{anchor(text)}">{_inline(text)}</h{level}>')
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
        elif line.startswith("- ") or _NUMBERED.match(line):
            tag = "ul" if line.startswith("- ") else "ol"
            items: list[str] = []
            while i < len(lines) and (_item(lines[i]) is not None or lines[i].startswith("  ") or not lines[i].strip()):
                if _item(lines[i]) is not None:
                    items.append(_inline(_item(lines[i])))
                    i += 1
                elif lines[i].strip().startswith("```"):
                    end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
                    code = "\n".join(x[2:] if x.startswith("  ") else x for x in lines[i + 1:end])
                    items[-1] += "<pre>" + html.escape(code) + "</pre>"
                    i = end + 1
                elif not lines[i].strip():
                    nxt = next((lines[j] for j in range(i, len(lines)) if lines[j].strip()), "")
                    if not (_item(nxt) is not None or nxt.startswith("  ")):
                        break
                    i += 1
                else:
                    items[-1] += " " + _inline(lines[i].strip())
                    i += 1
            out.append(f"<{tag}>" + "".join(f"<li>{item}</li>" for item in items) + f"</{tag}>")
        else:
            end = next((j for j in range(i, len(lines)) if not lines[j].strip()
                        or lines[j].startswith(("#", "|", "- ", "```")) or _NUMBERED.match(lines[j])), len(lines))
            text = " ".join(x.strip() for x in lines[i:end])
            cls = (' class="verdict fail"' if text.startswith(("**FAIL", "**INCOMPLETE"))
                   else ' class="verdict"' if text.startswith("**PASS") else "")
            out.append(f"<p{cls}>{_inline(text)}</p>")
            i = max(end, i + 1)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")


def write_html(markdown: str, base: Path, path: Path, *, title: str) -> Path:
    path.write_text(render_html(markdown, base, title=title), encoding="utf-8")
    return path
