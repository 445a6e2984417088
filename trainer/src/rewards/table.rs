//! The equivalence table: gold answers of MATH-500 and OlympiadBench (a few of Minerva math)
//! against rewritten forms (must match) and near misses (must not), each boxed and scored in
//! every extraction mode that reads `\boxed{}`.

use super::{parse_gold, verify, ExtractMode};

/// (gold answer as the data set writes it, a model's answer, equivalent)
const PAIRS: [(&str, &str, bool); 150] = [
    // Tuples and points.
    (
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "(3,\\frac{\\pi}{2})",
        true,
    ),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", true),
    (
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "\\left(3, \\dfrac{1}{2}\\pi\\right)",
        true,
    ),
    (
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "(\\frac{\\pi}{2}, 3)",
        false,
    ),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi)", false),
    ("(6,31,-1)", "(6, 31, -1)", true),
    ("(6,31,-1)", "(6,31,1)", false),
    ("(6,31,-1)", "(6,31)", false),
    ("\\left( \\frac{3}{2}, -13 \\right)", "(1.5, -13)", true),
    ("\\left( \\frac{3}{2}, -13 \\right)", "(3/2,13)", false),
    ("(-2,1)", "(-2, 1)", true),
    ("(-2,1)", "(1,-2)", false),
    (
        "$(1,8,19), (2,7,13), (4,5,7)$",
        "(4,5,7), (1,8,19), (2,7,13)",
        true,
    ),
    ("$(1,8,19), (2,7,13), (4,5,7)$", "(1,8,19), (2,7,13)", false),
    (
        "$(6,3),(9,3),(9,5),(54,5)$",
        "(9,5),(6,3),(54,5),(9,3)",
        true,
    ),
    (
        "$(6,3),(9,3),(9,5),(54,5)$",
        "(3,6),(9,3),(9,5),(54,5)",
        false,
    ),
    (
        "$(22+8 \\sqrt{6}, 22-8 \\sqrt{6})$,$(22-8 \\sqrt{6}, 22+8 \\sqrt{6})$",
        "(22-8\\sqrt6,22+8\\sqrt6),(22+8\\sqrt{6},22-8\\sqrt{6})",
        true,
    ),
    (
        "$(-\\sqrt{11},-2)\\cup (\\sqrt{11},9)$",
        "(\\sqrt{11},9)\\cup(-\\sqrt{11},-2)",
        true,
    ),
    // Intervals.
    ("(3,4]", "(3, 4]", true),
    ("(3,4]", "[3,4]", false),
    ("(3,4]", "(3,4)", false),
    (
        "\\left(\\frac{3}{5},\\frac{8}{3}\\right]",
        "(0.6, \\frac{8}{3}]",
        true,
    ),
    (
        "\\left(\\frac{3}{5},\\frac{8}{3}\\right]",
        "(0.6, 2.67]",
        false,
    ),
    ("(-\\infty, 0]", "(-\\infty,0]", true),
    ("(-\\infty, 0]", "(-\\infty,0)", false),
    ("(2,\\infty)", "(2, \\infty)", true),
    ("(0,9) \\cup (9,36)", "(9,36)\\cup(0,9)", true),
    ("(0,9) \\cup (9,36)", "(0,36)", false),
    (
        "(-\\infty, 2) \\cup (3, \\infty)",
        "(-\\infty,2)\\cup(3,\\infty)",
        true,
    ),
    ("x \\in [-2,7]", "[-2,7]", true),
    ("x \\in [-2,7]", "[-2,7)", false),
    ("(-\\sqrt{3}, \\sqrt{3})", "(-\\sqrt3,\\sqrt3)", true),
    ("$[\\frac{1}{2}, 8]$", "[0.5, 8]", true),
    (
        "\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]",
        "[\\frac{1}{8}\\pi^2, \\frac{5}{4}\\pi^2]",
        true,
    ),
    // Fractions, decimals, mixed numbers.
    ("\\frac{14}{3}", "\\dfrac{14}{3}", true),
    ("\\frac{14}{3}", "14/3", true),
    ("\\frac{14}{3}", "4\\frac{2}{3}", true),
    ("\\frac{14}{3}", "4.67", false),
    ("\\frac{3}{56}", "\\frac{6}{112}", true),
    ("\\frac{3}{56}", "\\frac{56}{3}", false),
    ("\\frac43", "\\frac{4}{3}", true),
    ("\\frac 59", "5/9", true),
    ("\\frac9{19}", "\\frac{9}{19}", true),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}", true),
    ("1\\frac{4}{5}", "\\frac{9}{5}", true),
    ("1\\frac{4}{5}", "1.8", true),
    ("1\\frac{4}{5}", "\\frac{4}{5}", false),
    ("137 \\frac{1}{2}", "137.5", true),
    ("137 \\frac{1}{2}", "275/2", true),
    ("\\dfrac{17}{50}", "0.34", true),
    ("\\dfrac{33}{100}", "0.33", true),
    ("\\dfrac{33}{100}", "0.333", false),
    ("-\\frac{35}{9}", "-35/9", true),
    ("-\\frac{35}{9}", "\\frac{35}{9}", false),
    ("\\frac{1997}{2}", "998.5", true),
    ("$-\\frac{30}{17}$", "\\frac{-30}{17}", true),
    ("$\\frac{-1}{1997}$", "-\\frac{1}{1997}", true),
    ("$1/3$", "\\frac{1}{3}", true),
    ("$\\frac{2016}{2017^{2}}$", "\\frac{2016}{4068289}", true),
    (
        "$\\frac{4 \\cdot 999^{4}}{27}$",
        "\\frac{4\\times 999^4}{27}",
        true,
    ),
    // Square roots.
    ("3\\sqrt{13}", "\\sqrt{117}", true),
    ("3\\sqrt{13}", "3 \\sqrt{13}", true),
    ("3\\sqrt{13}", "13\\sqrt{3}", false),
    ("3\\sqrt{13}", "\\sqrt{39}", false),
    ("11\\sqrt2", "\\sqrt{242}", true),
    ("11\\sqrt2", "11\\sqrt{3}", false),
    ("70 \\sqrt{2}", "70\\sqrt{2}", true),
    ("\\frac{3\\sqrt{3}}{4}", "\\frac{3}{4}\\sqrt{3}", true),
    ("\\frac{3\\sqrt{3}}{4}", "\\frac{\\sqrt{27}}{4}", true),
    ("\\frac{3\\sqrt{3}}{4}", "\\frac{9}{4\\sqrt{3}}", true),
    ("\\frac{3\\sqrt{3}}{4}", "\\frac{3\\sqrt{3}}{2}", false),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}", true),
    ("\\frac{\\sqrt{3}}{3}", "\\sqrt{3}/3", true),
    ("\\frac{\\sqrt{3}}{3}", "\\sqrt{\\frac{1}{3}}", true),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{\\sqrt{2}}{3}", false),
    ("1+2\\sqrt{3}", "2\\sqrt{3}+1", true),
    ("1+2\\sqrt{3}", "1+\\sqrt{12}", true),
    ("1+2\\sqrt{3}", "1+3\\sqrt{2}", false),
    ("11 \\sqrt{5} + 11", "11(\\sqrt5+1)", true),
    ("11 \\sqrt{5} + 11", "11\\sqrt{5}", false),
    ("$\\frac{-1+\\sqrt{5}}{2}$", "\\frac{\\sqrt{5}-1}{2}", true),
    ("$\\frac{-1+\\sqrt{5}}{2}$", "\\frac{2}{1+\\sqrt{5}}", true),
    ("$\\frac{-1+\\sqrt{5}}{2}$", "\\frac{1+\\sqrt{5}}{2}", false),
    (
        "$\\frac{15-8 \\sqrt{3}}{33}$",
        "\\frac{5}{11}-\\frac{8\\sqrt{3}}{33}",
        true,
    ),
    (
        "$\\sqrt{2}-1$,$\\frac{3-\\sqrt{2}}{7}$",
        "\\frac{1}{3+\\sqrt2}, \\frac{1}{1+\\sqrt{2}}",
        true,
    ),
    (
        "$\\frac{189 \\sqrt{11}}{11}$",
        "\\frac{189}{\\sqrt{11}}",
        true,
    ),
    ("$4-2 \\sqrt{3}$", "(\\sqrt{3}-1)^2", true),
    ("$4-2 \\sqrt{3}$", "4+2\\sqrt{3}", false),
    // Pi.
    ("\\pi", "\\pi", true),
    ("-\\frac{\\pi}{6}", "-\\pi/6", true),
    ("-\\frac{\\pi}{6}", "\\frac{\\pi}{6}", false),
    ("288 \\pi", "288\\pi", true),
    ("288 \\pi", "288", false),
    ("18+2\\pi", "2\\pi+18", true),
    ("18+2\\pi", "20\\pi", false),
    ("\\frac{20000}{\\pi}", "20000/\\pi", true),
    ("\\frac{20000}{\\pi}", "20000\\pi", false),
    (
        "$\\frac{5 \\pi}{4} \\sqrt{17}$",
        "\\frac{5\\sqrt{17}\\pi}{4}",
        true,
    ),
    ("$4 \\pi^{2}-1$", "-1+4\\pi^2", true),
    (
        "$\\frac{1}{6} \\pi, \\frac{5}{6} \\pi, \\frac{1}{4} \\pi, \\frac{3}{4} \\pi$",
        "\\frac{\\pi}{4},\\frac{3\\pi}{4},\\frac{\\pi}{6},\\frac{5\\pi}{6}",
        true,
    ),
    // Complex numbers.
    ("6 - 5i", "6-5i", true),
    ("6 - 5i", "-5i+6", true),
    ("6 - 5i", "6+5i", false),
    ("-2 + 7i", "-2+7i", true),
    ("1+274i", "274i+1", true),
    ("1 - 12i", "1-12 i", true),
    ("1 - 12i", "(1-2i)(1+2i)-4-12i", true),
    // Bases.
    ("52_8", "52_{8}", true),
    ("52_8", "52", true),
    ("52_8", "42", false),
    ("52_8", "52_9", false),
    ("4210_{5}", "4210_5", true),
    ("2516_8", "2516_{8}", true),
    // Text, units, percent, degrees.
    ("\\text{Evelyn}", "Evelyn", true),
    ("\\text{Evelyn}", "\\text{Evelin}", false),
    ("\\text{(C)}", "C", true),
    ("\\text{(C)}", "(C)", true),
    ("\\text{(C)}", "\\text{(D)}", false),
    ("90^\\circ", "90", true),
    ("90^\\circ", "90^{\\circ}", true),
    ("90^\\circ", "45^\\circ", false),
    ("864 \\mbox{ inches}^2", "864", true),
    ("5.4 \\text{ cents}", "5.4", true),
    ("\\$32,\\!348", "32348", true),
    ("\\$32,\\!348", "32,348", true),
    ("10,\\!080", "10080", true),
    ("11,\\! 111,\\! 111,\\! 100", "11111111100", true),
    ("62.5%", "62.5\\%", true),
    ("$8 \\%$", "8", true),
    // Sets of solutions.
    ("1,-2", "-2, 1", true),
    ("1,-2", "1", false),
    ("3, 5, 7", "7,5,3", true),
    ("3, 5, 7", "3,5", false),
    ("1 \\pm \\sqrt{19}", "1+\\sqrt{19}, 1-\\sqrt{19}", true),
    ("1 \\pm \\sqrt{19}", "1+\\sqrt{19}", false),
    ("3 \\pm 2 \\sqrt{2}", "3-2\\sqrt2,3+2\\sqrt2", true),
    ("\\{1\\pm\\sqrt{5},-2\\}", "-2, 1+\\sqrt5, 1-\\sqrt5", true),
    ("$a=2$, $a=-6-4 \\sqrt{2}$", "-6-4\\sqrt{2}, 2", true),
    (
        "$\\frac{32}{9}$,$\\frac{1}{2}$",
        "\\frac12, \\frac{32}{9}",
        true,
    ),
    ("$2^{-2 / 3}$, $8$", "8, 2^{-2/3}", true),
    // Scientific notation (Minerva math).
    ("4.5e33", "4.5 \\times 10^{33}", true),
    ("1e-5", "10^{-5}", true),
    ("1e-5", "10^{-4}", false),
    // Equations and expressions.
    ("x=5", "5", true),
    ("x=5", "x = 5", true),
    ("y = 2x + 3", "y=2x+3", true),
    ("x^3+3x-6", "x^3 + 3x - 6", true),
    ("x^3+3x-6", "x^3+3x+6", false),
    ("p - q", "p-q", true),
    ("$2^{1009}$", "2^{1009}", true),
];

#[test]
fn the_equivalence_table_holds_in_every_boxed_mode() {
    let (mut same, mut different) = (0, 0);
    for (gold, candidate, want) in PAIRS {
        let gold_answer = parse_gold(gold).unwrap_or_else(|e| panic!("{e}"));
        let completion = format!("Reasoning. The result is \\boxed{{{candidate}}}.");
        for mode in [
            ExtractMode::Boxed,
            ExtractMode::Strict,
            ExtractMode::Flexible,
        ] {
            let verdict = verify(&completion, false, &gold_answer, mode);
            assert_eq!(
                verdict.is_correct, want,
                "{candidate:?} vs gold {gold:?} ({mode}): gold parsed as {gold_answer}"
            );
        }
        if want {
            same += 1;
        } else {
            different += 1;
        }
    }
    assert!(
        same >= 50 && different >= 40,
        "{same} equivalent, {different} not"
    );
}
