// Typesets the formulas of the site's pages with the vendored KaTeX (assets/katex/). The
// Markdown extension pymdownx.arithmatex (generic mode) leaves each $...$ as
// <span class="arithmatex">\(...\)</span> and each $$...$$ as <div class="arithmatex">\[...\]</div>;
// this renders each in place. KATEX_OPTIONS is JSON (tests/test_docs.py reads it): the
// macros let docstrings keep the Unicode a terminal shows (‖x‖, ½) and still typeset.
const KATEX_OPTIONS = {
  "throwOnError": false,
  "strict": false,
  "macros": {"‖": "\\|", "½": "\\tfrac{1}{2}"}
};

function typesetMath(root) {
  for (const element of root.querySelectorAll(".arithmatex")) {
    const text = element.textContent.trim();
    const display = text.startsWith("\\[");
    const tex = text.slice(2, -2);
    katex.render(tex, element, Object.assign({ displayMode: display }, KATEX_OPTIONS));
  }
}

if (typeof document$ !== "undefined") {
  document$.subscribe(({ body }) => typesetMath(body));  // Material: each page, instant loading too
} else {
  document.addEventListener("DOMContentLoaded", () => typesetMath(document.body));
}
