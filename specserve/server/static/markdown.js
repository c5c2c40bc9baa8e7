/* A small Markdown renderer for model output: code fences, inline code, bold, italic, headings, lists, block
   quotes, rules and paragraphs, built as DOM nodes. Model text only ever becomes text nodes (never HTML), so
   output cannot inject markup; every piece of text keeps its offset in the source, so the caller can wrap
   it (the chat page wraps each token's part in a span). An ES module. */

const FENCE = /^ {0,3}(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+/;
const BULLET = /^\s*[-*+]\s+/;
const ORDERED = /^\s*\d{1,9}[.)]\s+/;
const QUOTE = /^ {0,3}>\s?/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
// code, **bold**, __bold__, *italic*: one line each; a marker must touch its text ("2 * 3 * 4" stays text)
const INLINE = /`([^`\n]+)`|\*\*(?=\S)([^*\n]*?\S)\*\*|__(?=\S)([^_\n]*?\S)__|\*(?=[^\s*])([^*\n]*?[^\s*])\*|\*([^\s*])\*/g;

function lineRanges(text) {
  const out = [];
  let start = 0;
  for (;;) {
    const nl = text.indexOf("\n", start);
    if (nl < 0) {
      out.push({ start, end: text.length });
      return out;
    }
    out.push({ start, end: nl });
    start = nl + 1;
  }
}

/* Renders `text` into `container`. emit(parent, start, end) appends text[start:end] to parent; the default
   appends one text node. */
export function render(text, container, emit) {
  emit = emit || ((parent, start, end) => parent.appendChild(document.createTextNode(text.slice(start, end))));
  const lines = lineRanges(text);
  const line = (i) => text.slice(lines[i].start, lines[i].end);
  let para = null; // {start, end} of the paragraph being collected
  let list = null; // the open <ul> or <ol>
  let quote = null; // the open <blockquote>

  const add = (tag, parent) => (parent || container).appendChild(document.createElement(tag));

  function inline(parent, start, end) {
    const sub = text.slice(start, end);
    let pos = 0;
    INLINE.lastIndex = 0;
    for (let m = INLINE.exec(sub); m; m = INLINE.exec(sub)) {
      if (m.index > pos) emit(parent, start + pos, start + m.index);
      const strong = m[2] !== undefined || m[3] !== undefined;
      const el = add(m[1] !== undefined ? "code" : strong ? "strong" : "em", parent);
      const width = strong ? 2 : 1;
      emit(el, start + m.index + width, start + m.index + m[0].length - width);
      pos = m.index + m[0].length;
    }
    if (pos < sub.length) emit(parent, start + pos, end);
  }

  function flush() {
    if (para) inline(add("p"), para.start, para.end);
    para = null;
  }

  function closeBlocks() {
    flush();
    list = null;
    quote = null;
  }

  for (let i = 0; i < lines.length; i++) {
    const { start, end } = lines[i];
    const s = line(i);
    let m;
    if ((m = FENCE.exec(s))) {
      closeBlocks();
      let j = i + 1;
      while (j < lines.length && line(j).trim() !== m[1]) j++;
      const pre = add("pre");
      const code = add("code", pre);
      if (m[2]) code.className = "language-" + m[2].replace(/[^\w-]/g, "");
      const bodyEnd = j < lines.length ? lines[j].start - 1 : text.length;
      if (i + 1 < lines.length && lines[i + 1].start <= bodyEnd) emit(code, lines[i + 1].start, bodyEnd);
      i = j;
    } else if (!s.trim()) {
      closeBlocks();
    } else if (RULE.test(s)) {
      closeBlocks();
      add("hr");
    } else if ((m = HEADING.exec(s))) {
      closeBlocks();
      inline(add("h" + Math.min(6, m[1].length + 2)), start + m[0].length, end);
    } else if ((m = BULLET.exec(s) || ORDERED.exec(s))) {
      flush();
      quote = null;
      const tag = BULLET.test(s) ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = add(tag);
        const first = parseInt(s, 10);
        if (tag === "ol" && first > 1) list.start = first;
      }
      inline(add("li", list), start + m[0].length, end);
    } else if (list && /^\s/.test(s) && list.lastChild) {
      // an indented line continues the list item above it
      emit(list.lastChild, start - 1, start);
      const indent = s.length - s.trimStart().length;
      inline(list.lastChild, start + indent, end);
    } else if ((m = QUOTE.exec(s))) {
      flush();
      list = null;
      if (!quote) quote = add("blockquote");
      else emit(quote, start - 1, start);
      inline(quote, start + m[0].length, end);
    } else {
      list = null;
      quote = null;
      if (para) para.end = end;
      else para = { start, end };
    }
  }
  flush();
}
