//! Plain-text tables with aligned columns.

/// Formats `rows` under `header`, columns separated by two spaces, the last column unpadded.
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        for (i, cell) in row.iter().enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  ", w = widths[i]));
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_align_to_the_widest_cell() {
        let t = super::render(
            &["#", "name"],
            &[vec!["10".into(), "a".into()], vec!["2".into(), "bb".into()]],
        );
        assert_eq!(t, "#   name\n10  a\n2   bb\n");
    }
}
