//! Text that other users control (command names, command lines, cgroup and file names) made
//! safe for a terminal: vramguard runs as root, and a process that names itself
//! `\e]52;c;…\a` must not write root's clipboard, nor `\r\e[2K\e[1A` rewrite the plan shown
//! above a confirmation prompt, nor a newline forge an output line.
//!
//! Every C0 control (newline and tab included), DEL, every C1 control and the Unicode
//! direction overrides are shown as visible escapes (`\e`, `\n`, `\x7f`, `\u{9b}`,
//! `\u{202e}`). Escaping is idempotent (its output has nothing left to escape), so text made
//! safe where it was composed can pass through a renderer again. JSON output keeps the exact
//! text instead (as JSON escapes).

use std::borrow::Cow;

/// Whether `c` must not reach a terminal as it is.
fn is_unsafe(c: char) -> bool {
    c.is_control()
        // Bidirectional marks, embeddings, overrides and isolates (the Arabic letter mark
        // included): they reorder what the reader sees (CVE-2021-42574).
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        // Line and paragraph separators: a line break to some terminals and viewers.
        || matches!(c, '\u{2028}' | '\u{2029}')
        // Invisible characters that make two names look alike or hide text: zero-width space,
        // joiners, word joiner and invisible operators, the byte-order mark, the Mongolian
        // vowel separator, and the tag characters.
        || matches!(c, '\u{200b}'..='\u{200d}' | '\u{2060}'..='\u{2064}' | '\u{feff}' | '\u{180e}' | '\u{e0000}'..='\u{e007f}')
}

/// `text` with every control character shown as a visible escape. Borrows when nothing needed
/// escaping (the common case).
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\x1b' => out.push_str("\\e"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x07' => out.push_str("\\a"),
            c if (c as u32) < 0x80 && is_unsafe(c) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if is_unsafe(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `text` escaped and cut to at most `max` characters, the cut marked with `…`.
pub fn fit(text: &str, max: usize) -> String {
    let escaped = escape(text);
    if escaped.chars().count() <= max {
        return escaped.into_owned();
    }
    let mut cut: String = escaped.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// The terminal columns `text` takes: two for a wide character (CJK, most emoji), none for a
/// combining mark. For text already escaped (nothing in it is a control character).
pub fn columns(text: &str) -> usize {
    text.chars()
        .map(|c| unicode_width::UnicodeWidthChar::width(c).unwrap_or(0))
        .sum()
}

/// `text` escaped and cut to at most `max` terminal columns, the cut marked with `…`: for a
/// table cell, where [`fit`]'s count of characters would let wide characters push the
/// columns after it out of line. A run of zero-width characters (combining marks) is cut
/// too: at most four characters per column.
pub fn fit_columns(text: &str, max: usize) -> String {
    let escaped = escape(text);
    let max_chars = max.saturating_mul(4);
    if columns(&escaped) <= max && escaped.chars().count() <= max_chars {
        return escaped.into_owned();
    }
    let room = max.saturating_sub(1);
    let mut cut = String::new();
    let mut used = 0;
    for (n, c) in escaped.chars().enumerate() {
        let w = unicode_width::UnicodeWidthChar::width(c).unwrap_or(0);
        if used + w > room || n + 1 >= max_chars {
            break;
        }
        cut.push(c);
        used += w;
    }
    if max > 0 {
        cut.push('…');
    }
    cut
}

/// [`fit_columns`], padded with spaces to exactly `width` columns: a table cell.
pub fn cell(text: &str, width: usize) -> String {
    let mut cut = fit_columns(text, width);
    let pad = width.saturating_sub(columns(&cut));
    cut.extend(std::iter::repeat_n(' ', pad));
    cut
}

/// Longest process-supplied string shown in a free-text line (a command line in a plan, an
/// evidence line): enough to recognise it, never a 1 MB line.
pub const MAX_SHOWN: usize = 200;

/// [`escape`] and cut to [`MAX_SHOWN`] characters: for process-supplied text embedded in a
/// sentence.
pub fn shown(text: &str) -> String {
    fit(text, MAX_SHOWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_escapes_become_visible() {
        let osc52 = "\x1b]52;c;aGVsbG8=\x07python3";
        assert_eq!(escape(osc52), "\\e]52;c;aGVsbG8=\\apython3");
        assert_eq!(escape("a\r\x1b[2K\x1b[1Ab"), "a\\r\\e[2K\\e[1Ab");
        assert_eq!(escape("two\nlines\t"), "two\\nlines\\t");
        assert_eq!(escape("del\x7f nul\0"), "del\\x7f nul\\x00");
        assert_eq!(escape("c1 \u{9b}31m"), "c1 \\u{9b}31m");
        assert_eq!(escape("rtl \u{202e}gpj.exe"), "rtl \\u{202e}gpj.exe");
        // Every direction embedding, override, isolate and mark; separators; invisible
        // characters.
        for c in [
            '\u{061c}', '\u{200e}', '\u{200f}', '\u{2028}', '\u{2029}', '\u{feff}',
        ]
        .into_iter()
        .chain('\u{202a}'..='\u{202e}')
        .chain('\u{2066}'..='\u{2069}')
        .chain('\u{200b}'..='\u{200d}')
        .chain('\u{2060}'..='\u{2064}')
        .chain(['\u{180e}', '\u{e0001}', '\u{e0041}', '\u{e007f}'])
        {
            assert_eq!(
                escape(&format!("a{c}b")),
                format!("a\\u{{{:x}}}b", c as u32)
            );
        }
        assert_eq!(escape(&escape("\x1b\n")), "\\e\\n", "idempotent");
        assert!(matches!(
            escape("python3 train.py ünïcode"),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn fit_cuts_after_escaping() {
        assert_eq!(fit("abcdef", 4), "abc…");
        assert_eq!(fit("ab", 4), "ab");
        assert_eq!(fit("\x1b\x1b\x1b", 4), "\\e\\…");
        assert_eq!(shown(&"x".repeat(1_400_000)).chars().count(), MAX_SHOWN);
    }

    #[test]
    fn table_cells_are_cut_and_padded_by_columns() {
        // Wide characters take two columns: four of them fill eight.
        assert_eq!(cell("训练任务", 8), "训练任务");
        assert_eq!(fit_columns("训练任务一", 8), "训练任…");
        assert_eq!(cell("训练任务一", 8), "训练任… ");
        // A wide character that would straddle the edge is left out, the cell padded.
        assert_eq!(cell("ab训练", 4), "ab… ");
        assert_eq!(cell("alice", 9), "alice    ");
        assert_eq!(cell("\x1b[2J", 9), "\\e[2J    ");
        // Combining marks take no column, but a cell holds at most four characters a column.
        let zalgo = format!("a{}", "\u{301}".repeat(1000));
        assert_eq!(fit_columns(&zalgo, 4).chars().count(), 16);
        assert_eq!(cell("", 0), "");
    }

    proptest::proptest! {
        #[test]
        fn a_cell_is_exactly_its_width(s in "\\PC{0,40}", width in 1usize..30) {
            let c = cell(&s, width);
            proptest::prop_assert_eq!(columns(&c), width, "{:?} → {:?}", s, c);
        }

        #[test]
        fn nothing_unsafe_survives(s in "\\PC*|[\\x00-\\x20\\x7f-\\u{9f}\\u{200e}\\u{200f}\\u{202a}-\\u{202e}\\u{2066}-\\u{2069}a-z]{0,40}") {
            let e = escape(&s);
            let leaked = e.chars().any(|c| {
                c.is_control()
                    || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
            });
            proptest::prop_assert!(!leaked, "{:?} escaped to {:?}", s, e);
        }
    }
}
