use super::*;

fn err(src: &str) -> String {
    gbnf_to_lark(src).unwrap_err().to_string()
}

#[test]
fn regular_root_is_one_terminal() {
    let lark = gbnf_to_lark("root ::= \"yes\" | \"no\"\n").unwrap();
    assert_eq!(lark, "start: T0\nT0: \"yes\" | \"no\"\n");
    let lark = gbnf_to_lark("root ::= item+\nitem ::= \"- \" [^\\n]+ \"\\n\"\n").unwrap();
    assert_eq!(
        lark,
        r#"start: T0
T0: (T1)+
T1: "- " (/[^\x{A}]/)+ "\n"
"#
    );
}

#[test]
fn recursive_grammars_use_one_character_lexemes() {
    let lark = gbnf_to_lark("root ::= \"(\" root? \")\" | \"ab\"").unwrap();
    assert_eq!(lark, "start: r0\nr0: (\"(\") (r0)? (\")\") | (\"a\" \"b\")\n");
}

#[test]
fn rules_continue_after_assign_bar_and_inside_groups() {
    let src = "root ::=\n  \"a\" (\n  \"b\" |\n  \"c\" ) # comment\n  | \"d\"\n";
    // A line starting with `|` does not continue a rule in llama.cpp.
    assert!(err(src).contains("line 5, column 3"), "{}", err(src));
    let ok = "root ::=\n  \"a\" (\n  \"b\" |\n  \"c\" ) |\n  \"d\" # comment\nx ::= \"e\"\n";
    assert_eq!(gbnf_to_lark(ok).unwrap(), "start: T0\nT0: \"a\" (\"b\" | \"c\") | \"d\"\n");
}

#[test]
fn escapes_and_classes() {
    let lark = gbnf_to_lark(r#"root ::= "\x41\u00e9\U0001F600\t\"\\" [a-z\-\]] [^\x00-\x1f] ."#).unwrap();
    assert!(lark.contains(r#""Aé😀\t\"\\""#), "{lark}");
    assert!(lark.contains(r"/[a-z\x{2D}\x{5D}]/"), "{lark}");
    assert!(lark.contains(r"/[^\x{0}-\x{1F}]/"), "{lark}");
    assert!(lark.contains(r"/[\x{0}-\x{10FFFF}]/"), "{lark}");
    // `-` before `]` is a literal dash.
    assert!(gbnf_to_lark("root ::= [a-]").unwrap().contains(r"/[a\x{2D}]/"));
}

#[test]
fn repetitions() {
    let lark = gbnf_to_lark("root ::= \"a\"{2} \"b\"{1,} \"c\"{0,3} \"d\"{2,2500}").unwrap();
    assert!(lark.contains("(\"a\"){2} (\"b\")+ (\"c\"){0,3} (\"d\"){2,}"), "{lark}");
}

#[test]
fn errors_name_line_and_column() {
    assert_eq!(err("root ::= \"a\"\nfoo ::= bar\n"), "invalid grammar: GBNF line 2, column 9: undefined rule 'bar'");
    assert!(err("root ::= \"a\nx").contains("unterminated string literal"));
    assert!(err("root ::= [a-").contains("unterminated character class"));
    assert!(err("root := \"a\"").contains("line 1, column 6: expecting ::="));
    assert!(err("foo ::= \"a\"").contains("no 'root' rule"));
    assert!(err("root ::= \"\\q\"").contains("unknown escape \\q"));
    assert!(err("root ::= \"\\x4\"").contains("expecting 2 hex digits"));
    assert!(err("root ::= \"\\uD800\"").contains("not a Unicode scalar value"));
    assert!(err("root ::= * \"a\"").contains("expecting an item before"));
    assert!(err("root ::= \"\"*").contains("expecting an item before"));
    assert!(err("root ::= \"a\"{2001}").contains("limit of 2000"));
    assert!(err("root ::= \"a\"{3,2}").contains("below its minimum"));
    assert!(gbnf_to_lark("root ::= (\"a\"{50}){50}").is_ok());
    assert!(err("root ::= (\"a\"{0,50}){0,50}").contains("more rules than llama.cpp allows"));
    assert!(err("root ::= ( \"a\"").contains("expecting ) to close"));
    assert!(err("root ::= <[1000]>").contains("token references"));
    assert!(err("root ::= \"a\" ]").contains("expecting a newline or the end"));
}

#[test]
fn left_recursion_is_refused_as_llama_cpp_does() {
    assert!(err("root ::= root \"a\" | \"b\"").contains("'root' is left-recursive"));
    assert!(err("root ::= \"a\"? root \"a\" | \"b\"").contains("left-recursive"));
    assert!(err("root ::= foo\nfoo ::= bar \"x\"\nbar ::= \"\" | foo").contains("left-recursive"));
    // Right recursion is fine.
    assert!(gbnf_to_lark("root ::= \"a\" root | \"b\"").is_ok());
}

#[test]
fn a_later_definition_replaces_an_earlier_one() {
    assert_eq!(gbnf_to_lark("root ::= \"a\"\nroot ::= \"b\"").unwrap(), "start: T0\nT0: \"b\"\n");
}

#[test]
fn class_repetitions_are_one_lexeme_only_where_greedy_lexing_is_exact() {
    let lark = |g: &str| gbnf_to_lark(g).unwrap();
    // Nothing after the digits can continue them: one lexeme.
    assert!(lark("root ::= \"(\" root \")\" | [0-9]+ \"s\"").contains("/[0-9]+/"));
    // "s" could continue [a-z]*: a character at a time.
    assert!(lark("root ::= \"(\" root \")\" | [a-z]* \"s\"").contains("(/[a-z]/)*"));
    // é and è share their first UTF-8 byte: the lexer would enter the run on è's first byte.
    assert!(lark("root ::= \"(\" root \")\" | [\\u00e9]+ \"\\u00e8\"").contains("(/[\\x{E9}]/)+"));
    // "b" may start where [a-z]+ starts.
    assert!(lark("root ::= \"(\" root \")\" | [a-z]+ \"1\" | \"b\" \"2\"").contains("(/[a-z]/)+"));
    // A JSON string's `(C | escape)*` becomes `C* (escape C*)*`, C one lexeme.
    let json = "root ::= \"[\" (s (\",\" s)*)? \"]\" | \"(\" root \")\"\ns ::= \"\\\"\" ([^\"\\\\] | \"\\\\\" [nt\"\\\\])* \"\\\"\"";
    assert!(lark(json).contains("(/[^\\x{22}\\x{5C}]+/)?"), "{}", lark(json));
}
