//! The file programs' answers read strictly, including hostile and malformed ones, and the
//! page rules (UTF-8 boundaries, image detection, modes).

use super::*;
use crate::backends::files::{FileError, ReadAnswer};

#[test]
fn a_read_answer_keeps_no_more_than_asked_for() {
    let answer = parse_read("/f", b"abcdef".to_vec(), b"ok 10\n", 4).unwrap();
    assert_eq!(
        answer,
        ReadAnswer {
            size: 10,
            bytes: b"abcd".to_vec()
        }
    );
}

#[test]
fn read_statuses_become_the_documented_errors() {
    assert_eq!(
        parse_read("/f", vec![], b"missing\n", 1),
        Err(FileError::NotFound("/f".into()))
    );
    assert_eq!(
        parse_read("/d", vec![], b"dir\n", 1)
            .unwrap_err()
            .to_string(),
        "/d is a directory; use file_list."
    );
    assert_eq!(
        parse_read("/f", vec![], b"ok x\n", 1),
        Err(FileError::Garbled("/f".into()))
    );
    assert_eq!(
        parse_read("/f", vec![], b"\xff\xfe", 1),
        Err(FileError::Garbled("/f".into()))
    );
    assert_eq!(
        parse_read("/f", vec![], b"", 1),
        Err(FileError::Garbled("/f".into()))
    );
}

#[test]
fn write_answers_are_read_strictly() {
    assert_eq!(parse_write("/f", b"ok\n"), Ok(None));
    assert_eq!(parse_write("/f", b"ok 12\n"), Ok(Some(12)));
    assert_eq!(
        parse_write("/f", b"dir\n"),
        Err(FileError::WriteToDirectory("/f".into()))
    );
    assert_eq!(
        parse_write("/f", b"failed cannot create the directory /a\n")
            .unwrap_err()
            .to_string(),
        "Could not write /f: cannot create the directory /a"
    );
    assert_eq!(
        parse_write("/f", b"ok -1\n"),
        Err(FileError::Garbled("/f".into()))
    );
    assert_eq!(
        parse_write("/f", b"whatever"),
        Err(FileError::Garbled("/f".into()))
    );
}

#[test]
fn listings_are_sorted_capped_and_skip_what_does_not_parse() {
    let answer = b"ok\n41ed 4096 1700000000 /r/b\n81a4 5 1700000001 /r/a\n\
a1ff 3 1700000002 /r/link\n2190 0 1 /r/tty\nbroken line\nnot-hex 1 1 /r/x\n81a4 1 1 relative\n";
    let listing = parse_list("/r", answer).unwrap();
    let summary: Vec<(String, String, u64, String)> = listing
        .entries
        .iter()
        .map(|e| (e.path.clone(), e.kind.to_string(), e.size, e.mode.clone()))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("/r/a".into(), "file".into(), 5, "0644".into()),
            ("/r/b".into(), "dir".into(), 4096, "0755".into()),
            ("/r/link".into(), "symlink".into(), 3, "0777".into()),
            ("/r/tty".into(), "other".into(), 0, "0620".into()),
        ]
    );
    assert!(!listing.truncated);

    let mut many = b"ok\n".to_vec();
    for n in 0..=LIST_LIMIT {
        many.extend_from_slice(format!("81a4 1 1 /r/{n:05}\n").as_bytes());
    }
    let listing = parse_list("/r", &many).unwrap();
    assert_eq!(listing.entries.len(), LIST_LIMIT);
    assert!(listing.truncated);
    assert_eq!(
        parse_list("/r", b"missing\n"),
        Err(FileError::NotFound("/r".into()))
    );
}

#[test]
fn text_pages_stop_before_a_cut_character_unless_the_file_ends() {
    let text = "añb€".as_bytes();
    assert_eq!(utf8_prefix(text, true), Some(text.len()));
    // "añb" and the first byte of "€"
    assert_eq!(utf8_prefix(&text[..5], false), Some(4));
    assert_eq!(utf8_prefix(&text[..5], true), None);
    assert_eq!(utf8_prefix(b"\xff\xfeab", false), None);
    assert_eq!(utf8_prefix(&"€".as_bytes()[..1], false), None);
}

#[test]
fn images_are_known_by_their_first_bytes() {
    assert_eq!(image_type(b"\x89PNG\r\n\x1a\nrest"), Some("image/png"));
    assert_eq!(image_type(b"\xff\xd8\xff\xe0"), Some("image/jpeg"));
    assert_eq!(image_type(b"GIF89a.."), Some("image/gif"));
    assert_eq!(image_type(b"RIFF\0\0\0\0WEBPVP8 "), Some("image/webp"));
    assert_eq!(image_type(b"RIFF\0\0\0\0WAVE"), None);
    assert_eq!(image_type(b"hello"), None);
}

#[test]
fn modes_and_temporary_paths() {
    assert_eq!(parse_mode("0755"), Some(0o755));
    assert_eq!(parse_mode("644"), Some(0o644));
    assert_eq!(parse_mode("4755"), Some(0o4755));
    for bad in ["0758", "75", "u+x", "07555", ""] {
        assert_eq!(parse_mode(bad), None, "{bad}");
    }
}

#[test]
fn a_base64_read_answer_is_decoded_and_kept_to_the_page() {
    let answer = parse_read_base64("/f", b"AAEC\n/w==\n", b"ok 9\n", 3).unwrap();
    assert_eq!(answer.bytes, [0, 1, 2]);
    assert_eq!(answer.size, 9);
    assert_eq!(
        parse_read_base64("/f", b"not base64!", b"ok 9\n", 3),
        Err(FileError::Garbled("/f".into()))
    );
    // 1 MiB as `base64` prints it (76 characters a line) fits the bound.
    let text = (1024 * 1024u64).div_ceil(3) * 4;
    assert!(base64_answer_len(1024 * 1024) >= text + text.div_ceil(76));
}

// See: issue 30 (item 2)
#[test]
fn issue_30_a_listing_is_read_to_its_limit_and_a_line_cut_by_the_budget_is_dropped() {
    let mut flood = b"ok\n".to_vec();
    for n in 0..200_000 {
        flood.extend_from_slice(format!("81a4 1 1 /{n:x}\n").as_bytes());
    }
    let listing = parse_list("/", &flood).unwrap();
    assert_eq!(listing.entries.len(), LIST_LIMIT);
    assert!(listing.truncated);
    // The program cut its output at the byte budget, in the middle of a line.
    let mut cut = b"ok\n".to_vec();
    while (cut.len() as u64) < 3 + LIST_ENTRY_BYTES {
        cut.extend_from_slice(format!("81a4 1 1 /{}\n", "p".repeat(4000)).as_bytes());
    }
    cut.truncate(usize::try_from(3 + LIST_ENTRY_BYTES).unwrap());
    let listing = parse_list("/", &cut).unwrap();
    assert!(listing.truncated);
    assert!(listing.entries.iter().all(|e| e.path.len() == 4001));
    // An answer without a newline after its status is an empty listing, not an error.
    assert_eq!(parse_list("/", b"ok").unwrap().entries, []);
}
