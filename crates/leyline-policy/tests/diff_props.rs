//! Property tests: applying the diff of two sequences to the first gives the second.

use leyline_policy::{apply_edits, diff, diff_tokens};
use proptest::prelude::*;

fn cuts(len: usize, raw: Vec<usize>) -> Vec<usize> {
    let mut b: Vec<usize> = raw.into_iter().map(|x| x % (len + 1)).collect();
    b.sort_unstable();
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn diff_tokens_round_trips(a in prop::collection::vec(0u32..4, 0..40),
                               b in prop::collection::vec(0u32..4, 0..40)) {
        let edits = diff_tokens(&a, &b);
        prop_assert!(edits.len() <= 1);
        prop_assert_eq!(apply_edits(&a, &edits).unwrap(), b);
    }

    #[test]
    fn diff_round_trips_with_any_bounds(a in prop::collection::vec(0u32..4, 0..40),
                                        b in prop::collection::vec(0u32..4, 0..40),
                                        ca in prop::collection::vec(0usize..100, 0..8),
                                        cb in prop::collection::vec(0usize..100, 0..8)) {
        let (ba, bb) = (cuts(a.len(), ca), cuts(b.len(), cb));
        let edits = diff(&a, &ba, &b, &bb).unwrap();
        for w in edits.windows(2) {
            prop_assert!(w[0].end < w[1].start, "sorted, apart: {:?}", edits);
        }
        prop_assert_eq!(apply_edits(&a, &edits).unwrap(), b);
    }

    /// Messages `[SEP, id, content.., END]` (as a chat template frames them): editing the
    /// contents of k messages gives k edits, each inside its message.
    #[test]
    fn one_edit_per_edited_message(contents in prop::collection::vec(prop::collection::vec(0u32..5, 0..8), 1..12),
                                   changes in prop::collection::vec((any::<prop::sample::Index>(), prop::collection::vec(0u32..5, 0..8)), 0..5),
                                   appended in prop::collection::vec(prop::collection::vec(0u32..5, 0..8), 0..3)) {
        const SEP: u32 = 1000;
        const END: u32 = 1001;
        let render = |msgs: &[Vec<u32>]| {
            let mut t = Vec::new();
            let mut b = Vec::new();
            for (i, m) in msgs.iter().enumerate() {
                b.push(t.len());
                t.push(SEP);
                t.push(2000 + i as u32);
                t.extend_from_slice(m);
                t.push(END);
            }
            b.push(t.len());
            (t, b)
        };
        let mut new = contents.clone();
        for (ix, c) in &changes {
            let i = ix.index(new.len());
            new[i].clone_from(c);
        }
        let changed = contents.iter().zip(&new).filter(|(x, y)| x != y).count();
        new.extend(appended.iter().cloned());
        let ((ta, ba), (tb, bb)) = (render(&contents), render(&new));
        let edits = diff(&ta, &ba, &tb, &bb).unwrap();
        if appended.is_empty() {
            prop_assert_eq!(edits.len(), changed);
            for (k, e) in edits.iter().enumerate() {
                // Inside one message's content: after its [SEP, id] header, before its END.
                let m = ba.partition_point(|&x| x <= e.start) - 1;
                prop_assert!(e.start >= ba[m] + 2 && e.end < ba[m + 1], "edit {} = {:?}", k, e);
            }
        } else {
            // The appended messages are one more edit at most; when the last message changed
            // the cheapest pairing may place them differently, but never costs more edits.
            prop_assert!(edits.len() <= changed + 1);
            if changed == 0 {
                prop_assert!(edits.len() == 1 && edits[0].is_append(ta.len()));
            }
        }
        prop_assert_eq!(apply_edits(&ta, &edits).unwrap(), tb);
    }
}
